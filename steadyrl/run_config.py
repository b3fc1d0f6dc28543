"""A run recipe (TOML) and what each service's settings become.

Sections: [run] (`RunSection`: what several services must agree on), [model] (path; "tiny" = the kit's tiny MoE),
[trainer], [inference], [orchestrator], [weightsync] (any STEADYRL_<SERVICE>_* field), and [teacher] (`PoolSection`: a
teacher pool for on-policy distillation). [run] values are copied into
every service, and a service section that sets one is refused. Every section is validated against its service's
settings model before any process starts, so a typo or a bad value is an error naming the field.

Details: docs/internals/cli.md"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shared.runtime.settings import StepShape, TrackingSettings

SERVICES = ("trainer", "inference", "orchestrator", "weightsync")
SETTINGS = {
    "trainer": ("services.trainer.config", "TrainerSettings"),
    "inference": ("services.inference.config", "InferenceSettings"),
    "orchestrator": ("services.orchestrator.config", "OrchestratorSettings"),
    "weightsync": ("services.weightsync.config", "WeightSyncSettings"),
}


class RunSection(StepShape):
    """[run]: what the whole run shares."""

    model_config = ConfigDict(extra="forbid")

    id: str = "run"
    """Run id: the Redis key space and the run directory's name."""
    replicas: int = Field(1, ge=1)
    """Inference replicas."""
    steps: int = Field(0, ge=0)
    """Global steps (0 = until stopped)."""
    max_restarts: int = Field(5, ge=0)
    """`steadyrl run`: restarts of one crashed service before the run gives up."""
    restart_backoff_seconds: float = Field(1.0, gt=0)
    """`steadyrl run`: first wait before a restart, doubled at each restart of the same service."""
    mini_batch_prompts: int = Field(0, ge=0)
    """The paper's batch geometry: when > 0 the mini-batch stays this many prompts and the global
    batch grows with the mini-batches, batch_prompts := trainer.mini_batches × this (replacing
    any batch_prompts given). 0: batch_prompts is fixed and N splits it."""
    tracking: TrackingSettings = TrackingSettings()
    """[run.tracking]: W&B and MLflow (off unless named), for the trainer and the orchestrator."""
    colocate: bool = False
    """`steadyrl run`: the replicas on the trainer's GPUs instead of their own (one machine with few
    GPUs; inference.gpus_per_replica <= trainer.parallel.gpus). Off: every process has its own GPUs."""

    @field_validator("id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        from shared.runstore.keys import check_run_id

        return check_run_id(value)


class ModelSection(BaseModel):
    """[model]: the policy every service loads."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field("tiny", min_length=1)
    """A Hugging Face model directory, or "tiny" (the cold-started tiny MoE, built for the run's
    task and cached on first use)."""


class PoolSection(BaseModel):
    """[teacher]: a pool of replicas serving a fixed model's per-token logprobs (on-policy
    distillation), its own processes beside the rollout replicas (docs/guides/pools.md)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)
    """The teacher's model directory (a Hugging Face directory, e.g. a finished run's final-model/);
    it shares the policy's tokenizer."""
    replicas: int = Field(1, ge=1)
    """Replicas of the pool (each its own process; the rollout replicas call them in turn)."""
    engine: Literal["torch"] = "torch"
    """The teacher's engine: torch (a prefill forward gives every token's logprob)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The teacher's precision."""
    torch_threads: int = Field(1, ge=0)
    """torch threads of each teacher replica (0: torch's default)."""


POOLS = ("teacher",)  # the pool sections a recipe may declare


# [run] field → the field it becomes in each service's settings
SHARED = {
    "trainer": {
        "id": "run_id",
        "batch_prompts": "batch_prompts",
        "group_size": "group_size",
        "max_staleness": "max_staleness",
        "steps": "max_steps",
        "tracking": "tracking",
    },
    "orchestrator": {
        "id": "run_id",
        "batch_prompts": "batch_prompts",
        "group_size": "group_size",
        "max_staleness": "max_staleness",
        "steps": "steps",
        "tracking": "tracking",
    },
    "inference": {"id": "run_id"},
    "weightsync": {"id": "run_id"},
}


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    teacher: PoolSection | None = None
    notes: list[str] = field(default_factory=list)
    """What resolving the recipe decided (written as comments atop config.resolved.toml)."""

    @property
    def run_id(self) -> str:
        return self.run.id

    @property
    def replicas(self) -> int:
        return self.run.replicas

    @property
    def steps(self) -> int:
        return self.run.steps

    def section(self, name: str) -> dict[str, Any]:
        return self.sections.setdefault(name, {})

    def as_toml(self) -> str:
        parts = ["".join(f"# {note}\n" for note in self.notes)] if self.notes else []
        parts += [_table("run", self.run.model_dump()), _table("model", self.model.model_dump())]
        parts += [_table(name, self.sections[name]) for name in SERVICES if self.sections.get(name)]
        if self.teacher is not None:
            parts.append(_table("teacher", self.teacher.model_dump()))
        return "\n".join(parts)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + "}"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _table(name: str, values: dict[str, Any]) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {_value(v)}\n" for k, v in values.items())


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` (value in TOML syntax, else a string) → (section, key, value). A key
    may be dotted (`trainer.loss.eps_low=0.1`) for a nested setting."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"--set expects section.key=value, got {text!r}")
    path, raw = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def _set(values: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for name in parents:
        child = values.setdefault(name, {})
        if not isinstance(child, dict):
            raise ValueError(f"{dotted}: {name} is a value, not a table")
        values = child
    values[last] = value


def merge_tables(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`top` over `base`: tables merge key by key (recursively), any other value replaces. Pure."""
    out = dict(base)
    for key, value in top.items():
        out[key] = (
            merge_tables(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
        )
    return out


def load_run_config(
    path: str | Path | Sequence[str | Path], overrides: Sequence[str] = (), allow_empty: bool = False
) -> RunConfig:
    """A recipe from one TOML file, or several merged left to right (a later file's keys win, tables
    merge key by key), then `--set` overrides (on the defaults alone with `allow_empty`)."""
    paths = [path] if isinstance(path, str | Path) else list(path)
    if not paths and not allow_empty:
        raise ValueError("no recipe file given")
    data: dict[str, Any] = {}
    for one in paths:
        if not Path(one).is_file():
            raise ValueError(f"recipe {one} does not exist")
        try:
            layer = tomllib.loads(Path(one).read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{one} is not valid TOML: {exc}") from None
        unknown = set(layer) - {"run", "model", *SERVICES, *POOLS}
        if unknown:
            raise ValueError(
                f"unknown sections {sorted(unknown)} in {one}; expected run, model, {', '.join(SERVICES + POOLS)}"
            )
        data = merge_tables(data, layer)
    run = dict(data.get("run", {}))
    model = dict(data.get("model", {}))
    pools = {name: dict(data[name]) for name in POOLS if name in data}
    sections = {name: json.loads(json.dumps(data.get(name, {}))) for name in SERVICES}
    for text in overrides:
        section, key, value = parse_override(text)
        if section == "run":
            run[key] = value
        elif section == "model":
            model[key] = value
        elif section in SERVICES:
            _set(sections[section], key, value)
        elif section in POOLS:
            _set(pools.setdefault(section, {}), key, value)
        else:
            raise ValueError(f"unknown section {section!r} in --set {text!r}")
    if run.get("mini_batch_prompts"):
        run["batch_prompts"] = mini_batches(sections["trainer"]) * run["mini_batch_prompts"]
    try:
        teacher = PoolSection(**pools["teacher"]) if "teacher" in pools else None
        config = RunConfig(RunSection(**run), ModelSection(**model), sections, teacher)
    except ValidationError as exc:
        section = "teacher" if exc.title == "PoolSection" else exc.title.removesuffix("Section").lower()
        raise ValueError(f"[{section}] {exc}") from None
    for service, shared in SHARED.items():
        clash = sorted(set(config.section(service)) & set(shared.values()))
        if clash:
            raise ValueError(
                f"[{service}] sets {clash}, which [run] declares for every service: set "
                f"{', '.join('run.' + k for k, v in shared.items() if v in clash)} instead"
            )
    return config


def mini_batches(trainer: Mapping[str, Any]) -> int:
    """N of a [trainer] section (its settings' default when unset)."""
    from services.trainer.config import TrainerSettings

    value = trainer.get("mini_batches", TrainerSettings.model_fields["mini_batches"].default)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"[trainer] mini_batches must be an integer >= 1, got {value!r}")
    return value
