"""Settings fields several models share, declared once: the shape of a global step, which the
trainer, the orchestrator and a recipe's [run] must agree on, the experiment tracking both log to,
and the trust in weight versions that the trainer, weight-sync and the replicas share."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.rpc import DEFAULT_MAX_MESSAGE_BYTES
from shared.runtime.service_lifecycle import Listen


class StepShape(BaseModel):
    batch_prompts: int = Field(8, ge=1)
    """B: prompts (complete groups of G) per global step."""
    group_size: int = Field(8, ge=1)
    """G: samples per prompt."""
    max_staleness: int = Field(1, ge=0)
    """Versions a rollout may lag the trainer when trained: admission keeps at most
    (max_staleness + 1) × B prompts outstanding for the trainer's version (plus
    orchestrator.lookahead_batches for versions to come), and the trainer drops older groups
    (0 = synchronous)."""


class TrackingSettings(BaseModel):
    """Experiment tracking beyond the TensorBoard files every run writes ([run.tracking], copied
    into the trainer, which logs every metrics.jsonl key per step, and the orchestrator, which logs
    the evals). Each backend is off until named, never required, and never stops training: it logs
    from a thread of its own, and a backend that fails is logged and dropped."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    wandb_project: str = ""
    """Weights & Biases project (empty: off). Needs the `wandb` extra (from the repository root:
    `.venv/bin/pip install -e '.[wandb]'`) and, online,
    WANDB_API_KEY in the environment. The trainer and the orchestrator log to two W&B runs of one
    group (the run id), `RUN/trainer` and `RUN/orchestrator`, resumed by a restarted service."""
    wandb_entity: str = ""
    """W&B entity (team or user; empty: the API key's default)."""
    wandb_mode: Literal["online", "offline"] = "online"
    """`offline`: W&B writes under the service's out_dir (`wandb/`), for `wandb sync` later."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking server, e.g. http://mlflow:5000 (empty: off). Needs the `mlflow` extra (from the
    repository root: `.venv/bin/pip install -e '.[mlflow]'`). One MLflow run per service, `RUN/trainer` and
    `RUN/orchestrator`, tagged steadyrl.run_id."""
    mlflow_experiment: str = "steadyrl"
    """MLflow experiment the runs go to (created when missing)."""

    @model_validator(mode="after")
    def _installed(self) -> TrackingSettings:
        import importlib.util

        for setting, module, extra in (
            ("wandb_project", "wandb", "wandb"),
            ("mlflow_tracking_uri", "mlflow", "mlflow"),
        ):
            if getattr(self, setting) and importlib.util.find_spec(module) is None:
                install = f".venv/bin/pip install -e '.[{extra}]'"
                raise ValueError(f"tracking.{setting} needs {module}: from the repository root, {install}")
        return self


class UnsignedWeights(BaseModel):
    unsigned_weights: bool = False
    """Publish (trainer) or take (weight-sync, replicas) weight versions without the trainer's
    signature. Then whoever holds the token can publish weights: for tests and a single trusted
    process, never a deployment (docs/security.md)."""
    run_instance: str = Field("", pattern=r"^([0-9a-f]{32})?$")
    """The run's instance, signed into every version (32 hexadecimal characters): a version that
    carries another — an earlier run's — is refused. Empty: the one in the run's Redis, made there
    by the first service of the run (docs/security.md)."""


class VerifiedWeights(UnsignedWeights):
    """The fields of a service that takes only versions the run's trainer signed."""

    verify_key_file: Path | None = None
    """The run's public key (64 hexadecimal characters, `steadyrl keys DIR` makes a pair): only
    versions signed with its private key, the trainer's, are taken. Required unless
    unsigned_weights."""

    def _needs_key(self, what: str) -> None:
        if self.verify_key_file is None and not self.unsigned_weights:
            raise ValueError(
                f"{what} takes only versions the run's trainer signed: set verify_key_file (the "
                "public key; `steadyrl keys DIR` makes a pair), or unsigned_weights = true"
            )


class ServiceSettings(BaseSettings):
    """What every service's settings have (each also a `RedisSettings`): the run, the address its
    servers bind to and where it listens (`listen`); no setting takes an infinite or NaN number. TLS
    and the token are the deployment's, the same for every service (STEADYRL_TLS_*,
    STEADYRL_TOKEN_FILE: docs/security.md), read where the servers start."""

    model_config = SettingsConfigDict(allow_inf_nan=False, hide_input_in_errors=True)  # an error never echoes a secret

    run_id: str = "default"
    """The run it serves ([run] id)."""
    host: str = "127.0.0.1"
    """Address the gRPC server binds to."""

    def listen(self) -> Listen:
        """Where its gRPC API and /metrics listen."""
        raise NotImplementedError


class ApiServiceSettings(ServiceSettings):
    """A service with a gRPC API and its own /metrics port (the trainer, the replicas, weight-sync;
    the orchestrator serves /metrics on its HTTP port: its own `listen`)."""

    port: int = Field(0, ge=0, le=65535)
    """gRPC port (0 = any free port)."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Prometheus /metrics port (0 = any free port)."""
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=64 * 1024)
    """Largest gRPC message accepted or sent."""

    def listen(self) -> Listen:
        return Listen(self.host, self.port, self.max_message_bytes, self.metrics_port, self.run_id)
