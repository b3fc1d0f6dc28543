"""`steadyrl bench …`: each benchmark prints one JSON object of side-by-side ratios (bench/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

bench_app = typer.Typer(help="Benchmarks: each prints one JSON object of side-by-side ratios.")


@bench_app.command("weightsync")
def bench_weightsync(
    layers: int = typer.Option(11, min=1, help="Layers of the bench model (11: 1.09 GiB in bf16)."),
    rounds: int = typer.Option(3, min=1, help="Timed rounds per side (median), transports alternated."),
    engines: str = typer.Option("torch,vllm", help="Replica engines, comma-separated."),
    replicas: str = typer.Option("1,2", help="Replica counts, comma-separated."),
) -> None:
    """End-to-end refit, from the trainer's last optimizer step to every replica serving the new
    version (its first token), per transport, with 1 and 2 replicas, on both engines, against
    memcpy of the same bytes and a raw loopback socket, all on one clock; replica pause, wire
    bytes and peak memory growth; delta size after one optimizer step."""
    import json

    from bench.weightsync import main as run

    typer.echo(json.dumps(run(layers, rounds, tuple(engines.split(",")), tuple(int(n) for n in replicas.split(",")))))


@bench_app.command("inference")
def bench_inference(dtype: str = typer.Option("bfloat16", help="Inference precision of both engines.")) -> None:
    """Long-tail workload on both engines: continuous vs batch-barrier replica, replica vs bare engine,
    publication → first token of a version in flight vs drain-first."""
    import json

    from bench.inference import main as run

    typer.echo(json.dumps(run(dtype)))


@bench_app.command("mismatch")
def bench_mismatch(
    device: str = typer.Option("cpu", help="Where the engine and the fp32 trainer run: cpu or cuda."),
) -> None:
    """Training–inference mismatch per inference precision (fp32, bf16, fp8, NVFP4) on the tiny
    MoE: mismatch KL, |Δ logprob|, routing agreement vs the fp32 trainer."""
    import json

    from bench.mismatch import main as run

    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device is cpu or cuda, not {device!r}")
    typer.echo(json.dumps(run(device)))


@bench_app.command("trainer")
def bench_trainer(
    memory: bool = typer.Option(False, "--memory", help="DDP vs FSDP memory per rank instead."),
    gpu: bool = typer.Option(False, "--gpu", help="fp32 vs bf16-mixed steps on GPU 0 instead."),
    checkpoint: bool = typer.Option(
        False,
        "--checkpoint",
        help="Sharded (DCP, blocking and async) vs full-gather checkpoints, and R3 trace bytes, instead.",
    ),
) -> None:
    """Loss-math share of a step and the routing replay overhead of a training forward; with
    --memory, parameter + optimizer bytes and peak memory per rank, DDP vs FSDP on 2 gloo ranks;
    with --gpu, step time, tokens/s and peak memory on one GPU, fp32 vs bf16-mixed; with
    --checkpoint, rank 0's memory and the step time during a save, DCP vs full gather, and the
    bytes per token of a 30B-A3B-shaped routing trace."""
    import json

    if memory + gpu + checkpoint > 1:
        raise typer.BadParameter("--memory, --gpu and --checkpoint are three benchmarks: ask for one")
    if checkpoint:
        from bench.trainer_checkpoint import main as run
    elif memory:
        from bench.trainer_memory import main as run
    elif gpu:
        from bench.trainer_gpu import main as run
    else:
        from bench.trainer import main as run
    typer.echo(json.dumps(run()))


@bench_app.command("transport")
def bench_transport(rounds: int = typer.Option(3, help="Alternating rounds (median).")) -> None:
    """Rollouts through Redis (encode, XADD, XREADGROUP, decode + validate) vs raw XADD of the same bytes."""
    from bench.transport import main as run

    typer.echo(json.dumps(run(rounds)))


@bench_app.command("multiturn")
def bench_multiturn() -> None:
    """Multi-turn rollouts vs single-turn rollouts of the same total tokens, through the replica."""
    from bench.multiturn import main as run

    typer.echo(json.dumps(run()))


@bench_app.command("lora")
def bench_lora() -> None:
    """LoRA vs full: bytes per version, trainer step time and held bytes."""
    from bench.lora import main as run

    typer.echo(json.dumps(run()))


@bench_app.command("async")
def bench_async(
    target: float = typer.Option(0.5, help="Greedy eval accuracy to reach."),
    steps: int = typer.Option(200, help="Steps of each run."),
) -> None:
    """Wall time to a target eval accuracy: synchronous vs max_staleness 1 and 2, same compute."""
    from bench.asynchrony import main as run

    typer.echo(json.dumps(run(target, steps)))


@bench_app.command("dynamic-sampling")
def bench_dynamic_sampling(steps: int = typer.Option(200, min=2, help="Steps of each run.")) -> None:
    """The demo with and without dynamic sampling, the same steps: trained tokens per second (all, and
    those of groups with unequal rewards), the filtered share, wall time, evals."""
    from bench.dynamic_sampling import main as run

    typer.echo(json.dumps(run(steps)))


@bench_app.command("pools")
def bench_pools(
    steps: int | None = typer.Option(None, min=2, help="Steps of each student run (default: bench/pools.py's)."),
    target: float = typer.Option(0.5, help="Eval accuracy the students race to (besides the teacher's)."),
    judge_steps: int = typer.Option(200, min=2, help="Steps of the run on the tiny judge's verdicts."),
) -> None:
    """Teacher and judge pools: scoring / generation tokens/s, rollouts/s with a teacher pool / without,
    the steps a distilled student and an RL student need to reach `target` and the teacher's accuracy,
    and RL on the tiny judge's verdicts (eval gain, judge/exact agreement, rollouts/s with the judge / the rule)."""
    from bench.pools import main as run

    chosen = {"steps": steps} if steps else {}
    typer.echo(json.dumps(run(target=target, judge_steps=judge_steps, **chosen)))


@bench_app.command("demo")
def bench_demo(runs: int = typer.Option(3, min=1, help="Runs, one after another.")) -> None:
    """The demo as it ships (`steadyrl run configs/tiny-arith.toml`), several runs: eval accuracy at the
    start, end and best, wall seconds of the command and of its steps, tokens, tasks dropped, idle shares,
    the load; each figure's min–max. `bench all --only demo --update --json docs/results.json` records it
    where the pages quoting the demo read it."""
    from bench.demo import main as run

    typer.echo(json.dumps(run(runs)))


@bench_app.command("exact")
def bench_exact(pairs: int = typer.Option(3, min=1, help="Demo runs of each side, run in turn.")) -> None:
    """Exact mode's cost and effect (docs/guides/exact.md): the torch engine's tokens/s on the demo's step,
    exact / normal (bf16 as shipped, and fp32); a demo-sized trainer step's seconds, normal / exact; the
    demo with `configs/tiny-arith-exact.toml` beside `configs/tiny-arith.toml`, eval at equal steps."""
    from bench.exact import main as run

    typer.echo(json.dumps(run(pairs)))


@bench_app.command("weight_patches")
def bench_weight_patches(
    rounds: int = typer.Option(
        18, min=2, help="Timed versions of the ~100M model per transport (shm, collective), whole and patch alternated."
    ),
    demo_rounds: int = typer.Option(18, min=2, help="Timed versions of the demo's model per transport."),
) -> None:
    """Patch versions against whole ones by shm and by collective, side by side (docs/internals/weights.md): a ~100M
    Qwen3-MoE at lr 1e-6 (real Adam steps) and the demo's model at lr 1e-3: the share of bf16 elements changed,
    bytes per version patch / whole, refit seconds patch / whole per transport with their spread, the replica's
    pause, the load."""
    from bench.weight_patches import main as run

    typer.echo(json.dumps(run(rounds, demo_rounds)))


@bench_app.command("peers")
def bench_peers(
    steps: int = typer.Option(0, min=0, help="Steps of each side (0: the recipe's, as the demo ships)."),
    every: int = typer.Option(10, min=1, help="Steps between the models both sides' evals score."),
    peer_python: str = typer.Option(
        "", help="A Python with TRL (default .venv-compare/bin/python: STEADYRL_EXTRAS=compare scripts/install)."
    ),
    pairs: int = typer.Option(3, min=1, help="Interleaved runs of each side; the ratios are of their mean curves."),
) -> None:
    """steadyrl (as the demo ships, and with its evals off) against TRL's GRPOTrainer at its fastest
    on the tiny demo, the recipe matched (printed beside the result): wall seconds per step, the
    whole command, seconds to an eval accuracy, eval at equal steps (one eval loop), the load."""
    from steadyrl.peers import main as run

    typer.echo(json.dumps(run(steps, every, peer_python=peer_python or None, pairs=pairs)))


@bench_app.command("all")
def bench_all(
    only: Annotated[list[str] | None, typer.Option("--only", help="Run only this benchmark (repeatable).")] = None,
    markdown: Annotated[Path | None, typer.Option(help="Also write the markdown summary here.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the JSON here.")] = None,
    update: Annotated[
        bool,
        typer.Option(
            help="With --only and --json: keep the other benchmarks' figures from that file (same machine), each dated."
        ),
    ] = False,
) -> None:
    """Every benchmark, each in its own process: one JSON object with the machine it ran on."""
    from bench.suite import main as run
    from bench.suite import markdown as render

    previous = json.loads(json_out.read_text()) if update and json_out and json_out.exists() else None
    result = run(only or [], previous)
    text = json.dumps(result)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
    if markdown:
        markdown.write_text(render(result))
    typer.echo(text)
