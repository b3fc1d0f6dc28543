"""The `steadyrl` command line. Subcommands import their heavy dependencies (torch, grpc) lazily,
so `steadyrl --help` is instant."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from shared.runtime.exit_codes import ExitCode

app = typer.Typer(
    name="steadyrl",
    help="Asynchronous RL for LLM post-training with training–inference mismatch correction.",
    no_args_is_help=True,
    add_completion=False,
)


def examples(*lines: str) -> str:
    """A command's help epilog: its examples, kept line by line (click rewraps other paragraphs)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


@app.command()
def version() -> None:
    """Print the installed steadyrl version and its key dependencies."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    for name in ("steadyrl", "torch", "transformers", "grpcio", "protobuf", "redis"):
        try:
            typer.echo(f"{name} {dist_version(name)}")
        except PackageNotFoundError:
            typer.echo(f"{name} (not installed)")


@app.command("init-model")
def init_model(
    out: str = typer.Option(..., help="Directory to write the HF model into."),
    task: str = typer.Option(
        "arith", help="Task the cold start trains on; `judge`: the tiny judge of arith; `teacher`: the tiny teacher."
    ),
    seed: int = typer.Option(0, help="Seed of the init and the cold start."),
    check_precision: bool = typer.Option(True, help="Report fp32 vs bf16 routing agreement."),
) -> None:
    """Build the tiny Qwen3-MoE (character tokenizer, SFT cold start), cached by content; with
    `--task judge` the tiny judge, with `--task teacher` the tiny teacher (docs/guides/pools.md)."""
    import json
    from pathlib import Path

    from shared.kit.tiny import init_tiny_model
    from shared.kit.tiny_precision import precision_routing_agreement
    from shared.runtime.logs import setup_logging
    from steadyrl.recipe import KIT_POOL_MODELS, kit_pool_model

    setup_logging("init-model")  # a first build's progress lines (stderr; the report is stdout's)
    path = kit_pool_model(task, out, seed) if task in KIT_POOL_MODELS else init_tiny_model(out, task=task, seed=seed)
    report = json.loads((Path(path) / "steadyrl_tiny.json").read_text())
    report.pop("spec", None)
    if check_precision:
        report["bf16_vs_fp32"] = precision_routing_agreement(path)
    typer.echo(json.dumps({"out": str(path), **report}, indent=2))


@app.command(
    "run",
    epilog=examples(
        "steadyrl run configs/tiny-arith.toml",
        "steadyrl run configs/tiny-arith.toml --set run.steps=50 --out runs/try",
        "steadyrl run configs/tiny-arith.toml --dry-run",
    ),
)
def run_command(
    configs: Annotated[
        list[Path], typer.Argument(exists=True, dir_okay=False, help="Run recipe(s) (TOML), merged left to right.")
    ],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override: section.key=value (repeatable).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Run directory (default runs/<id>-<time>).")] = None,
    progress: Annotated[
        str,
        typer.Option(
            "--progress",
            help="auto (rich on a terminal, else plain) | rich | plain (a log line every ~5% of the steps) | none.",
        ),
    ] = "auto",
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the resolved recipe, every service's settings and the placement as JSON, start nothing.",
        ),
    ] = False,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus",
            min=0,
            help="With --dry-run: resolve for a machine or "
            "deployment of this many GPUs instead of this one (its datasets and "
            "engines not checked): what compose or the manifests give each "
            "service.",
        ),
    ] = None,
) -> None:
    """Start every service on loopback, run the recipe to the end and write the report.

    Exit codes: 0 finished, 1 failed, 2 recipe refused (nothing started), 3 stopped on request
    (POST /v1/run/stop), 130 interrupted (Ctrl-C, SIGTERM)."""
    import time as _time

    from shared.runtime.logs import setup_logging
    from steadyrl.launcher import run
    from steadyrl.progress import PROGRESS
    from steadyrl.recipe import load_recipe
    from steadyrl.service_settings import check, resolved
    from steadyrl.summary import exit_code, out_dir_in_use

    setup_logging("run")
    named = " + ".join(str(c) for c in configs)
    try:
        if progress not in PROGRESS:
            raise ValueError(f"--progress must be one of {', '.join(PROGRESS)}, got {progress!r}")
        recipe = load_recipe(configs, set_ or [])
        if dry_run and gpus is not None:
            typer.echo(json.dumps(resolved(recipe, gpus), indent=2))
            return
        if gpus is not None:
            raise ValueError("--gpus goes with --dry-run: a run uses this machine's GPUs")
        settings = check(recipe)
        if dry_run:
            typer.echo(json.dumps(resolved(recipe), indent=2))
            return
        if settings["trainer"].parallel.nodes > 1:
            raise ValueError(
                f"trainer.parallel.nodes = {settings['trainer'].parallel.nodes}: `steadyrl run` starts one machine; a "
                "multi-node trainer runs `steadyrl trainer-node` on every node under a job launcher "
                "(deploy/slurm/trainer.sbatch, the JobSet in deploy/k8s/components/multinode-trainer)"
            )
        if out is not None and (busy := out_dir_in_use(out)):  # nothing of a run there is overwritten
            raise ValueError(busy)
    except ValueError as exc:
        typer.echo(f"steadyrl run: {named}: {exc}", err=True)
        raise typer.Exit(ExitCode.REFUSED) from None
    out = out or Path("runs") / f"{recipe.run_id}-{_time.strftime('%Y%m%d-%H%M%S')}"
    summary = run(recipe, out, progress)
    typer.echo(
        json.dumps(
            {
                k: summary.get(k)
                for k in ("outcome", "steps", "versions", "eval_start", "eval_end", "wall_seconds", "out")
            }
        )
    )
    if code := exit_code(summary.get("outcome")):
        raise typer.Exit(code)


@app.command(
    "plan",
    epilog=examples(
        "steadyrl plan configs/gpu-qwen3-moe-math.toml",
        "steadyrl plan configs/tiny-arith.toml --json",
    ),
)
def plan_command(
    configs: Annotated[list[Path], typer.Argument(exists=True, dir_okay=False, help="Run recipe(s) (TOML).")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override: section.key=value (repeatable).")] = None,
    model_config: Annotated[
        Path | None,
        typer.Option(
            "--model-config",
            exists=True,
            help="The model's config.json or directory, when the recipe's model directory is not on this machine.",
        ),
    ] = None,
    disk_gbps: Annotated[
        float, typer.Option("--disk-gbps", min=0.001, help="Aggregate checkpoint write rate, GB/s.")
    ] = 2.0,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of the table.")] = False,
) -> None:
    """Size a recipe from its model's config: trainer memory per rank, checkpoint bytes and write
    time, weight version and weight-sync memory, Redis for a full queue, GPUs per service.
    Arithmetic, not a measurement. Exit code 2: recipe refused."""
    from steadyrl.plan import plan_recipe, render
    from steadyrl.recipe import load_recipe, resolve_model
    from steadyrl.service_settings import settings_of

    named = " + ".join(str(c) for c in configs)
    try:
        recipe = load_recipe(configs, set_ or [])
        settings = settings_of(recipe)  # sized for the recipe, not for this machine
        source = str(model_config) if model_config else resolve_model(recipe)  # "tiny": built when needed
        result = plan_recipe(recipe, settings, source, disk_gbps * 1e9)
    except ValueError as exc:
        typer.echo(f"steadyrl plan: {named}: {exc}", err=True)
        raise typer.Exit(ExitCode.REFUSED) from None
    typer.echo(json.dumps(result, indent=2) if as_json else render(result, recipe.run_id))


@app.command(
    "export",
    epilog=examples(
        "steadyrl export runs/tiny-arith-TIME --out exported/",
    ),
)
def export_command(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            exists=True, file_okay=False, help="A run directory, its trainer/checkpoints, or one step-* directory."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="The Hugging Face directory to write.")],
    model: Annotated[
        Path | None,
        typer.Option(
            "--model", help="The base model directory (its config and tokenizer); default: the one the run trained."
        ),
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16 | float16.")] = "bfloat16",
    merge: Annotated[
        bool,
        typer.Option(
            "--merge/--adapter",
            help="A LoRA run's checkpoint: the base with the adapter "
            "merged in (--merge), or the adapter alone in PEFT's "
            "format (the default).",
        ),
    ] = False,
) -> None:
    """A trainer checkpoint as a Hugging Face directory: AutoModelForCausalLM.from_pretrained loads it;
    a LoRA run's is its adapter in PEFT's format (PeftModel.from_pretrained(base, OUT)), or with
    --merge the base with the adapter merged in."""
    from steadyrl.report import export_checkpoint, find_checkpoint

    try:
        from steadyrl.evaluation import DTYPES

        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be {', '.join(DTYPES[:-1])} or {DTYPES[-1]}, got {dtype!r}")
        step, trained = find_checkpoint(checkpoint)
        base = str(model) if model else trained
        if not base:
            raise ValueError("--model is needed: the checkpoint does not say which model it trained")
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out} exists and is not empty")
        export_checkpoint(base, step, out, dtype, merge)
    except ValueError as exc:
        typer.echo(f"steadyrl export: {exc}", err=True)
        raise typer.Exit(ExitCode.REFUSED) from None
    typer.echo(json.dumps({"checkpoint": str(step), "model": base, "out": str(out), "dtype": dtype}))


@app.command(
    "eval",
    epilog=examples(
        "steadyrl eval runs/tiny-arith-TIME/final-model --config configs/tiny-arith.toml",
    ),
)
def eval_command(
    model_dir: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="HF model directory.")],
    config: Annotated[
        list[Path] | None,
        typer.Option(
            "--config",
            exists=True,
            dir_okay=False,
            help="Run recipe(s): its eval sets, prompts and reward (repeatable, merged left to right).",
        ),
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override: section.key=value (repeatable).")] = None,
    task: Annotated[str | None, typer.Option(help="Shortcut for --set orchestrator.data.task=...")] = None,
    size: Annotated[int | None, typer.Option(help="Shortcut for --set orchestrator.evals.size=...")] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option(help="Shortcut for --set orchestrator.sampling.max_new_tokens=...")
    ] = None,
    math_path: Annotated[Path | None, typer.Option(help="Shortcut for --set orchestrator.data.math_path=...")] = None,
    samples: Annotated[int, typer.Option(min=0, help="Samples per prompt for pass@k / mean@k (0: greedy only).")] = 4,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16 | float16.")] = "float32",
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is visible) | cpu | cuda.")] = "auto",
    served: Annotated[
        bool,
        typer.Option(
            "--served", help="As the recipe's replicas serve it: inference dtype and quantization (not --dtype)."
        ),
    ] = False,
) -> None:
    """Greedy accuracy (and pass@k, mean@k) of a model on a recipe's eval sets, as its run scores them."""
    from steadyrl.evaluation import evaluate

    shortcuts = {
        "data.task": task,
        "evals.size": size,
        "sampling.max_new_tokens": max_new_tokens,
        "data.math_path": str(math_path) if math_path else None,
    }
    overrides = [*(set_ or []), *(f"orchestrator.{k}={json.dumps(v)}" for k, v in shortcuts.items() if v is not None)]
    try:
        report = evaluate(str(model_dir), config or [], overrides, samples, dtype, device, served)
    except (ValueError, KeyError) as exc:
        typer.echo(f"steadyrl eval: {exc}", err=True)
        raise typer.Exit(ExitCode.REFUSED) from None
    typer.echo(json.dumps(report))


@app.command("keys")
def keys_command(
    directory: Annotated[Path, typer.Argument(file_okay=False, help="Where the two key files go.")],
    force: Annotated[bool, typer.Option("--force", help="Replace a key pair already there.")] = False,
) -> None:
    """Make the weight-signing key pair of a deployment: `weights-signing-key` (private, mode 0600:
    the trainer's alone) and `weights-verify-key` (public: weight-sync's and the replicas'). A pair
    already there is kept unless --force (replicas holding its public key would refuse the new one's)."""
    from shared.weightsync.signing import write_key_pair

    try:
        private, public = write_key_pair(directory, replace=force)
    except FileExistsError as exc:
        typer.echo(f"steadyrl keys: {exc}", err=True)
        raise typer.Exit(ExitCode.REFUSED) from None
    typer.echo(
        json.dumps(
            {"signing_key_file": str(private), "verify_key_file": str(public), "verify_key": public.read_text().strip()}
        )
    )


@app.command("replay-alerts")
def replay_alerts_command(
    run_dirs: Annotated[list[Path], typer.Argument(exists=True, file_okay=False, help="Run directories.")],
    rules: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="Prometheus rule file.")] = Path(
        "deploy/prometheus/alerts.yml"
    ),
) -> None:
    """Which alerts on the trainer's metrics would have fired on a finished run, and at which steps
    (its metrics.jsonl replayed one step per minute through `promtool test rules`)."""
    from steadyrl.alert_replay import replay_run

    for run_dir in run_dirs:
        typer.echo(json.dumps(replay_run(run_dir, rules)))


@app.command(
    "experiment",
    epilog=examples(
        "steadyrl experiment configs/paper-grid.toml --seeds 3 --out runs/grid",
    ),
)
def experiment_command(
    grid: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Grid of configurations (TOML).")],
    seeds: Annotated[int, typer.Option(min=1, help="Seeds per configuration (0..K-1).")] = 3,
    out: Annotated[Path, typer.Option(help="Directory of the runs, the table and the plots.")] = Path(
        "runs/experiment"
    ),
    only: Annotated[list[str] | None, typer.Option("--only", help="Run only this configuration (repeatable).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override for every run (repeatable).")] = None,
    report_only: Annotated[bool, typer.Option(help="Write the table and plots from the runs already there.")] = False,
) -> None:
    """Run a grid of configurations × seeds (each a full run), then write table.md, results.csv and plots."""
    from shared.runtime.logs import setup_logging
    from steadyrl.experiment import run_grid, write_report
    from steadyrl.grid import load_grid

    setup_logging("experiment")
    spec = load_grid(grid)
    if report_only:
        configs = [c for c in spec.configs if not only or c.name in only]
        result = write_report(spec, configs, seeds, out, echo=lambda line: typer.echo(line, err=True))
    else:
        result = run_grid(spec, seeds, out, only or [], set_ or [], echo=lambda line: typer.echo(line, err=True))
    typer.echo(json.dumps(result))


from steadyrl.bench_cli import bench_app  # noqa: E402 - the subcommands beside the app they join
from steadyrl.deploy_cli import secret_command, serve_command, trainer_node_command  # noqa: E402

app.add_typer(bench_app, name="bench")
app.command("trainer-node")(trainer_node_command)
app.command("serve")(serve_command)
app.command("secret")(secret_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
