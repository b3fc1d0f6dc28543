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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
