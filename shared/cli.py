"""The `steadyrl` command line. Subcommands import their heavy dependencies (torch, grpc) lazily,
so `steadyrl --help` is instant."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="steadyrl",
    help="Asynchronous RL for LLM post-training with training–inference mismatch correction.",
    no_args_is_help=True,
    add_completion=False,
)


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
    task: str = typer.Option("arith", help="Task the cold start trains on."),
    seed: int = typer.Option(0, help="Seed of the init and the cold start."),
    check_precision: bool = typer.Option(True, help="Report fp32 vs bf16 routing agreement."),
) -> None:
    """Build the tiny Qwen3-MoE (character tokenizer, SFT cold start), cached by content."""
    import json
    from pathlib import Path

    from shared.models.tiny import init_tiny_model, precision_routing_agreement

    path = init_tiny_model(out, task=task, seed=seed)
    report = json.loads((Path(path) / "steadyrl_tiny.json").read_text())
    report.pop("spec", None)
    if check_precision:
        report["bf16_vs_fp32"] = precision_routing_agreement(path)
    typer.echo(json.dumps({"out": str(path), **report}, indent=2))


bench_app = typer.Typer(help="Benchmarks: each prints one JSON object of side-by-side ratios.")
app.add_typer(bench_app, name="bench")


@bench_app.command("weightsync")
def bench_weightsync(gib: float = typer.Option(1.0, help="Size of the synthetic state dict.")) -> None:
    """gRPC full pull vs raw TCP on loopback; delta size after one optimizer step."""
    import json

    from bench.weightsync import main as run

    typer.echo(json.dumps(run(gib)))


@bench_app.command("inference")
def bench_inference(dtype: str = typer.Option("bfloat16", help="Inference precision of both engines.")) -> None:
    """Replica tokens/s vs the bare engine (service overhead), and torch vs vllm."""
    import json

    from bench.inference import main as run

    typer.echo(json.dumps(run(dtype)))


@bench_app.command("trainer")
def bench_trainer() -> None:
    """Loss-math share of a step and the routing replay overhead of a training forward."""
    import json

    from bench.trainer import main as run

    typer.echo(json.dumps(run()))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
