"""A run recipe (TOML) and what each service's settings become.

Sections: [run] (`RunSection`: what several services must agree on), [model] (path; "tiny" = the kit's tiny MoE),
[trainer], [inference], [orchestrator], [weightsync] (any STEADYRL_<SERVICE>_* field), and [teacher] / [judge]
(`PoolSection`: a teacher pool for on-policy distillation, a judge pool for model-judged rewards). [run] values are
copied into every service, and a service section that sets one is refused. Every section is validated against its
service's settings model before any process starts, so a typo or a bad value is an error naming the field.

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
    """Run id: the Redis key space and the run directory's name (no slash, brace, colon or space)."""
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
    """[teacher] or [judge]: a pool of replicas on a fixed model, its own processes beside the
    rollout replicas, which call them in turn with bounded waits. A teacher serves per-token
    logprobs (on-policy distillation); a judge serves verdicts for `judge:NAME` rewards, or a
    sequence-classification model's scalars for `reward_model:NAME` (the templates:
    [inference.judge.templates.NAME]). docs/guides/pools.md"""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)
    """The model directory (a Hugging Face directory, e.g. a finished run's final-model/), or
    "tiny-judge" / "tiny-teacher" (the kit's judge of the arith task, its teacher of unpadded sums: built
    and cached on first use). A teacher shares the policy's tokenizer; a judge reads text with its own."""
    replicas: int = Field(1, ge=1)
    """Replicas of the pool (each its own process; the rollout replicas call them in turn)."""
    engine: Literal["torch", "vllm"] = "torch"
    """The pool's engine: torch (a teacher's prefill forward gives every token's logprob) or vllm (its
    prompt logprobs); a judge generates its verdicts greedily on either; a reward model needs none."""
    max_model_len: int = Field(1024, ge=16)
    """vllm: the longest prompt + completion the pool serves (at most the model's positions)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The pool's precision."""
    torch_threads: int = Field(1, ge=0)
    """torch threads of each replica of the pool (0: torch's default)."""
    gpus_per_replica: int = Field(0, ge=0)
    """GPUs of each replica of the pool, its own (after the trainer's and the rollout replicas'); 0: the CPU."""


POOLS = ("teacher", "judge")  # the pool sections a recipe may declare
KIT_POOL_MODELS = {"teacher": "tiny-teacher", "judge": "tiny-judge"}  # each pool's kit model, by its name


def kit_pool_model(pool: str, out: str | Path | None = None, seed: int = 0) -> Path:
    """The kit's model of a pool (`teacher` or `judge`), built and cached on first use; copied to `out` if given."""
    if pool == "judge":
        from shared.kit.tiny_judge import init_tiny_judge

        return init_tiny_judge(out, seed=seed)
    from shared.kit.tiny_teacher import init_tiny_teacher

    return init_tiny_teacher(out, seed=seed)


def resolve_pool_model(path: str) -> str:
    """A pool's model directory: `path`, or the kit's model it names (built and cached on first use)."""
    pool = next((role for role, kit in KIT_POOL_MODELS.items() if kit == path), None)
    return str(kit_pool_model(pool)) if pool else path


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
    judge: PoolSection | None = None
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

    def pool(self, name: str) -> PoolSection | None:
        """The [teacher] or [judge] pool (None when the recipe has none)."""
        return getattr(self, name)

    def as_toml(self) -> str:
        parts = ["".join(f"# {note}\n" for note in self.notes)] if self.notes else []
        parts += [_table("run", self.run.model_dump()), _table("model", self.model.model_dump())]
        parts += [_table(name, self.sections[name]) for name in SERVICES if self.sections.get(name)]
        parts += [_table(name, self.pool(name).model_dump()) for name in POOLS if self.pool(name) is not None]
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


def _pool(name: str, values: dict[str, Any]) -> PoolSection:
    try:
        pool = PoolSection(**values)
    except ValidationError as exc:
        raise ValueError(f"[{name}] {exc}") from None
    other = next((kit for role, kit in KIT_POOL_MODELS.items() if role != name and pool.path == kit), None)
    if other:
        raise ValueError(
            f"[{name}] path = {other!r} is the kit's {other.removeprefix('tiny-')}: a {name} pool takes "
            f"{KIT_POOL_MODELS[name]!r} or a model directory"
        )
    return pool


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
        for name in POOLS:
            if name in pools:
                pools[name] = _pool(name, pools[name])
        config = RunConfig(RunSection(**run), ModelSection(**model), sections, pools.get("teacher"), pools.get("judge"))
    except ValidationError as exc:
        raise ValueError(f"[{exc.title.removesuffix('Section').lower()}] {exc}") from None
    for service, shared in SHARED.items():
        clash = sorted(set(config.section(service)) & set(shared.values()))
        if clash:
            raise ValueError(
                f"[{service}] sets {clash}, which [run] declares for every service: set "
                f"{', '.join('run.' + k for k, v in shared.items() if v in clash)} instead"
            )
    check_judged_rewards(config)
    check_distillation(config)
    return config


def check_distillation(config: RunConfig) -> None:
    """[trainer.distill] needs the [teacher] pool that scores its rollouts, and a [teacher] pool
    needs a distillation that reads it: ValueError naming what is missing, before any process starts."""
    from services.trainer.config import DistillSettings

    try:  # the trainer's own rule; a table it refuses is reported where its settings are checked
        distils = DistillSettings(**config.section("trainer").get("distill", {})).enabled
    except ValidationError:
        return
    if distils and config.teacher is None:
        raise ValueError("[trainer.distill] needs a teacher pool: add [teacher] with the teacher model's path")
    if config.teacher is not None and not distils:
        raise ValueError(
            "[teacher] starts a teacher pool that nothing reads: set trainer.distill.coef or top_k (with top_k_coef)"
        )


def check_judged_rewards(config: RunConfig) -> None:
    """A `judge:NAME` / `reward_model:NAME` reward needs the [judge] pool and template NAME in
    [inference.judge.templates], and a [judge] pool needs a reward that uses it: ValueError naming
    what is missing, before any process starts."""
    from shared.tasks.judging import model_reward

    orchestrator = config.section("orchestrator")
    rewards = [orchestrator.get("reward", ""), orchestrator.get("evals", {}).get("reward", "")]
    judged = [(name, model_reward(name)) for name in rewards if name and model_reward(name)]
    templates = config.section("inference").get("judge", {}).get("templates", {})
    if config.judge is not None and not judged:
        raise ValueError(
            '[judge] starts a judge pool that no reward uses: set orchestrator.reward = "judge:NAME" '
            'or "reward_model:NAME"'
        )
    for name, (kind, template) in judged:
        if config.judge is None:
            raise ValueError(f"reward {name!r} needs a judge pool: add [judge] with the judge model's path")
        if template not in templates:
            raise ValueError(
                f"reward {name!r} names the template {template!r}: add [inference.judge.templates.{template}] "
                f"(a prompt naming {{response}}); defined: {sorted(templates)}"
            )
        if config.judge.path == KIT_POOL_MODELS["judge"] and kind == "reward_model":
            raise ValueError(f"reward {name!r}: {config.judge.path} writes verdicts (judge:), it is no reward model")
        if Path(config.judge.path).is_dir():
            from shared.engines.classifier import is_classifier

            if (kind == "reward_model") != is_classifier(config.judge.path):
                raise ValueError(
                    f"reward {name!r}: the judge model {config.judge.path} is "
                    f"{'a sequence classifier' if kind == 'judge' else 'not a sequence classifier'}; "
                    f"{kind}: needs {'a causal LM that writes a verdict' if kind == 'judge' else 'one'}"
                )


def mini_batches(trainer: Mapping[str, Any]) -> int:
    """N of a [trainer] section (its settings' default when unset)."""
    from services.trainer.config import TrainerSettings

    value = trainer.get("mini_batches", TrainerSettings.model_fields["mini_batches"].default)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"[trainer] mini_batches must be an integer >= 1, got {value!r}")
    return value
