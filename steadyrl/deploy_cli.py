"""The deployment's commands of `steadyrl` (registered in steadyrl/cli.py): `serve`, one service
as compose and the manifests start it, `trainer-node`, one node of the trainer as a job
launcher (srun, a JobSet pod) starts it, and `secret`, a new token or password for a deployment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from shared.runtime.exit_codes import ExitCode


def trainer_node_command(
    configs: Annotated[
        list[Path] | None,
        typer.Argument(
            exists=True,
            dir_okay=False,
            help="Run recipe(s) (TOML); "
            "none: STEADYRL_RECIPE's, else the trainer's settings from the environment alone.",
        ),
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override: section.key=value (repeatable).")] = None,
    node_rank: Annotated[
        int | None,
        typer.Option(
            "--node-rank",
            min=0,
            help="This node's fixed node rank (a JobSet pod's completion index: global rank 0 on node 0); "
            "omitted: the order in which the nodes reach the rendezvous.",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print the command and the trainer's variables (secrets masked) as JSON, start nothing."
        ),
    ] = False,
) -> None:
    """One node of the trainer, as a job launcher starts it on every node (srun, a JobSet pod):
    torchrun with the recipe's trainer settings, meeting the other nodes at the weight-sync service
    (trainer.parallel.nodes, trainer.parallel.rdzv_endpoint: its address; the deployment's token).
    Variables STEADYRL_TRAINER_* already in the environment (addresses, secrets) win over the recipe.
    Exit code 2: settings refused (nothing started)."""
    import os
    import sys

    from steadyrl.placement import node_argv
    from steadyrl.recipe import load_recipe, resolve_model
    from steadyrl.service_settings import build_settings, recipe_overrides, service_env

    try:
        if not configs and os.environ.get("STEADYRL_RECIPE", "").strip():  # a deployment's recipe
            configs = [Path(p.strip()) for p in os.environ["STEADYRL_RECIPE"].split(",") if p.strip()]
            set_ = [*recipe_overrides(os.environ), *(set_ or [])]
        recipe = load_recipe(configs, set_ or []) if configs else None
        env = service_env(recipe, "trainer") if recipe else {}
        env.update({k: v for k, v in os.environ.items() if k.startswith("STEADYRL_TRAINER_")})
        settings = build_settings("trainer", env)
        nodes = settings.parallel.nodes
        if node_rank is not None and node_rank >= nodes:
            ranks = "0" if nodes == 1 else f"0 to {nodes - 1}"
            raise ValueError(
                f"--node-rank {node_rank} is past the last node: trainer.parallel.nodes = {nodes}, ranks {ranks}"
            )
        if not settings.parallel.rdzv_endpoint:
            raise ValueError(
                "trainer.parallel.rdzv_endpoint is unset: the nodes meet at the weight-sync service, so set it to "
                "that service's host:port (--set trainer.parallel.rdzv_endpoint=HOST:PORT, or "
                "STEADYRL_TRAINER_PARALLEL__RDZV_ENDPOINT)"
            )
    except ValueError as exc:
        typer.echo(f"steadyrl trainer-node: {exc}", err=True)
        raise typer.Exit(ExitCode.REFUSED) from None
    argv = node_argv(settings.parallel, settings.parallel.rdzv_id or settings.run_id, node_rank)
    if dry_run:
        from pydantic import SecretStr

        secret = {f"STEADYRL_TRAINER_{name.upper()}" for name, value in settings if isinstance(value, SecretStr)}
        shown = {k: ("***" if k in secret or any(w in k for w in ("PASSWORD", "TOKEN")) else v) for k, v in env.items()}
        typer.echo(json.dumps({"argv": [sys.executable, *argv], "env": shown}, indent=2))
        return
    if recipe and env.get("STEADYRL_TRAINER_MODEL_PATH") == "tiny":
        env["STEADYRL_TRAINER_MODEL_PATH"] = resolve_model(recipe)
    resolved = ("STEADYRL_RECIPE", "STEADYRL_RECIPE_SET")  # into `env` already
    ranks = {k: v for k, v in os.environ.items() if k not in resolved}
    os.execvpe(sys.executable, [sys.executable, *argv], {**ranks, **env})


def serve_command(
    service: Annotated[str, typer.Argument(help="weightsync | trainer | inference | orchestrator")],
    model_wait: Annotated[
        float,
        typer.Option(
            "--model-wait",
            min=0,
            help="Seconds to wait for the service's model_path to hold a model (a job beside it may still "
            "be writing it, as compose's model-init does); 0: it must be there at start.",
        ),
    ] = 0.0,
) -> None:
    """Run one service as a deployment starts it (compose, the Kubernetes manifests): its settings
    from the recipe STEADYRL_RECIPE names (a file, or several merged left to right, comma-separated:
    the service's section and [run], resolved as `steadyrl run` resolves them; STEADYRL_RECIPE_SET:
    `section.key=value` overrides of it, a line or a `;` each), under its own STEADYRL_<SERVICE>_*
    variables; without STEADYRL_RECIPE, from those variables alone.
    Exit code 2: settings refused (nothing started)."""
    import os

    from shared.rpc.auth import token_from_env
    from shared.rpc.secret_files import PlaceholderSecret, refuse_placeholder_files
    from shared.runtime.service_main import run_service
    from steadyrl.recipe import SERVICES
    from steadyrl.service_settings import deployed_settings, settings_class

    if service not in SERVICES:
        typer.echo(f"steadyrl serve: the service is one of {', '.join(SERVICES)}, not {service!r}", err=True)
        raise typer.Exit(ExitCode.REFUSED)
    try:
        settings = deployed_settings(service, os.environ)
    except ValueError as exc:
        typer.echo(
            f"steadyrl serve: event=settings_refused service={service} reason={exc}".replace("\n", " "), err=True
        )
        raise typer.Exit(ExitCode.REFUSED) from None
    try:  # no usable secret (a placeholder, empty, no readable file): refused before anything starts
        settings.bearer_token() if hasattr(settings, "bearer_token") else token_from_env()
        refuse_placeholder_files(settings)
    except PlaceholderSecret as exc:
        typer.echo(f"steadyrl serve: event=settings_refused service={service} reason={exc}", err=True)
        raise typer.Exit(ExitCode.REFUSED) from None
    if getattr(settings, "model_path", None) in KIT_MODELS:  # built here and cached, as `steadyrl run` builds it
        from shared.runtime.logs import setup_logging

        setup_logging(service)  # the build's progress lines, before the service's own logging starts
        settings.model_path = kit_model_of(settings.model_path, os.environ)
    if model_wait and getattr(settings, "model_path", None):
        _wait_for_model(service, settings.model_path, model_wait)
    run_service(service, settings_class(service), f"services.{service}.server", settings=settings)


KIT_MODELS = ("tiny", "tiny-judge", "tiny-teacher")  # the kit's models a recipe may name


def kit_model_of(name: str, environ) -> str:
    """The directory of a kit model a deployed service loads: a pool's (tiny-judge, tiny-teacher), or
    the tiny policy built for the task of the deployment's recipe (the arith task without one)."""
    from shared.kit.tiny import init_tiny_model
    from steadyrl.recipe import resolve_model, resolve_pool_model
    from steadyrl.service_settings import deployed_recipe

    if name != "tiny":
        return resolve_pool_model(name)
    recipe = deployed_recipe(environ)
    return resolve_model(recipe) if recipe is not None else str(init_tiny_model())


def _wait_for_model(service: str, path: str, seconds: float) -> None:
    from shared.models.loading import wait_for_model

    def waiting(waited: int) -> None:
        typer.echo(f"steadyrl serve: event=waiting_for_model service={service} path={path} waited={waited}", err=True)

    try:
        wait_for_model(path, seconds, waiting)
    except FileNotFoundError as exc:
        typer.echo(f"steadyrl serve: event=model_missing service={service} reason={exc}", err=True)
        raise typer.Exit(ExitCode.REFUSED) from None


def secret_command() -> None:
    """Print a new random secret (32 random bytes, URL-safe base64: 43 characters) for a deployment's
    token, Redis's password or Grafana's (`STEADYRL_TOKEN=$(steadyrl secret)` in .env, or
    `--from-literal=token=$(steadyrl secret)` in the Kubernetes Secret). The weight keys:
    `steadyrl keys DIR`."""
    import secrets

    typer.echo(secrets.token_urlsafe(32))
