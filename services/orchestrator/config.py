"""Settings of the orchestrator (env prefix STEADYRL_ORCHESTRATOR_)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.orchestrator.stop_rules import StopRules
from shared.rollouts.sampling import check_temperature
from shared.runstore.redis_client import RedisSettings
from shared.runtime.moved_settings import refuse_moved
from shared.runtime.settings import ServiceSettings, StepShape, TrackingSettings
from shared.tasks.trace import MulTraceTask

EVAL_SET_NAME = re.compile(r"[a-z0-9_]+")


class DataSource(BaseModel):
    """The prompts of one source: a task kind and its dataset (the fields of [orchestrator.data] and of
    each of its mixture's sources)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    task: Literal["arith", "math", "mul_trace", "calc", "verifiers"] = "arith"
    """Dataset: synthetic addition, a local math file, multiplication as a worked trace of
    partial sums (answer lengths heavy-tailed up to `trace_max_answer_tokens`), 2-digit
    multiplication with a calculator tool (multi-turn: environment `calc`), or the dataset of the
    `verifiers:` environment that plays the run."""
    seed: int = 0
    """Seed of the arith task's split."""
    math_path: Path | None = None
    """Math: the training problems — JSONL, JSON, CSV, Parquet or a `save_to_disk` dataset directory."""
    math_eval_path: Path | None = None
    """Math: the evaluation problems; unset = the last evals.size rows of math_path, held out of training."""
    prompt_column: str = ""
    """Math: the prompt column (empty: the first of prompt, problem, question the rows have)."""
    answer_column: str = ""
    """Math: the answer column (empty: the first of answer, solution, ground_truth)."""
    allow_eval_overlap: bool = False
    """Allow eval problems that are also training problems (refused by default: evals would measure
    memorisation)."""
    train_size: int = Field(3000, ge=1)
    """Training prompts (cycled over epochs)."""
    chat_template: Literal["auto", "none"] = "auto"
    """`auto`: prompts go through the tokenizer's chat template when it has one (the user's message,
    then the assistant's turn opened); `none`: raw text. The exact tokens travel in each rollout."""
    system_prompt: str = ""
    """With a chat template: a system message before every prompt (empty: none)."""
    arith_digits: int = Field(2, ge=1)
    """Arith: digits per operand."""
    arith_fixed_width: bool = True
    """Arith: zero-pad operands."""
    arith_reverse: bool = True
    """Arith: answers least-significant digit first."""
    trace_max_answer_tokens: int = Field(MulTraceTask.max_answer_tokens, ge=8)
    """mul_trace: the longest answer, in characters (= tokens with the tiny model's tokenizer)."""
    trace_alpha: float = Field(MulTraceTask.alpha, gt=0)
    """mul_trace: power-law exponent of the answer length (smaller = heavier tail)."""

    @model_validator(mode="after")
    def _dataset_named(self) -> DataSource:
        if self.task == "math" and self.math_path is None:
            raise ValueError("data.task 'math' needs data.math_path")
        return self


class MixtureSource(DataSource):
    """One source of a data mixture ([[orchestrator.data.mixture]]): its own task and dataset, reward
    and eval split, drawn in proportion to its weight."""

    name: str = Field(max_length=64)
    """The source's name, carried by each of its tasks and rollouts: lower-case letters, digits and _,
    not 'main' nor an evals.sets name (its eval split is the eval set of this name)."""
    weight: float = Field(1.0, gt=0)
    """Its share of the training tasks: weight / the sum of the weights."""

    @model_validator(mode="before")
    @classmethod
    def _no_nested_mixture(cls, values):
        if isinstance(values, dict) and "mixture" in values:
            raise ValueError("a mixture source cannot have a mixture of its own")
        return values

    @field_validator("name")
    @classmethod
    def _source_name(cls, value: str) -> str:
        if not EVAL_SET_NAME.fullmatch(value) or value == "main":
            raise ValueError(
                f"mixture source name {value!r}: lower-case letters, digits and _, and not 'main' "
                "(the union of the sources' eval splits)"
            )
        return value

    @field_validator("task")
    @classmethod
    def _not_verifiers(cls, value: str) -> str:
        if value == "verifiers":
            raise ValueError(
                "task 'verifiers' cannot be a mixture source: its environment plays the whole run with its own dataset"
            )
        return value


class DataSettings(DataSource):
    """The training and eval prompts ([orchestrator.data])."""

    mixture: list[MixtureSource] = []
    """Several training sources instead of one: each `[[orchestrator.data.mixture]]` table holds a
    `name`, a `weight` and the fields above for its own dataset (the fields above are then left at
    their defaults). Task i draws from the sources in proportion to their weights, spread evenly over
    every window of tasks (services/orchestrator/mixture.py); each task and rollout carries its source's
    name. Each source has its own reward (the run's `reward` when set), its own eval split (the eval set
    of its name; `main` is their union) and metrics `source/NAME/reward_mean` and `source/NAME/rollouts`
    in the trainer's step line. Empty: one source, this table."""

    @model_validator(mode="after")
    def _mixture_sound(self) -> DataSettings:
        if not self.mixture:
            return self
        beside = [name for name, field in DataSource.model_fields.items() if getattr(self, name) != field.get_default()]
        if beside:
            raise ValueError(
                f"data.{', data.'.join(beside)} set beside data.mixture: each source sets its own, in its "
                "[[orchestrator.data.mixture]] table"
            )
        names = [source.name for source in self.mixture]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"mixture source names must be unique: {repeated} repeated")
        from services.orchestrator.mixture import CYCLE, quotas

        starved = [
            name for name, quota in zip(names, quotas([s.weight for s in self.mixture]), strict=True) if not quota
        ]
        if starved:
            raise ValueError(
                f"mixture sources {starved} weigh too little to draw one task in {CYCLE}: raise their weights"
            )
        return self

    def sources(self) -> list[DataSource]:
        """The mixture's sources, or this one."""
        return [*self.mixture] or [self]


def checked_reward(name: str) -> str:
    """The reward name unchanged if the replicas can score it: a rule is loaded and called once in a
    reward process; a model-judged one (`judge:` / `reward_model:`) is checked against the judge
    templates by `steadyrl run` and by each replica."""
    from shared.tasks.judging import is_model_reward

    if name and not is_model_reward(name):
        from shared.tasks.reward_runner import check_reward

        check_reward(name, "0", "0")
    return name


class EvalSettings(BaseModel):
    """Eval rounds ([orchestrator.evals])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    every: int = Field(10, ge=0)
    """Evaluate (greedy) every this many versions, plus at the start and the end (0 = never)."""
    size: int = Field(300, ge=1)
    """Evaluation prompts (of the task's own eval set, and at most this many of each of `sets`)."""
    sets: dict[str, Path] = {}
    """More eval sets beside the task's own (named `main`): name → a local dataset in any format
    data.math_path takes, read with data.prompt_column / answer_column, prompts as written (the math task's
    instruction added in a math run). Every eval round scores each with the run's reward; eval.jsonl
    gives each set's accuracy under `sets`, TensorBoard, W&B and MLflow as `eval_set/NAME/accuracy`, Prometheus as
    steadyrl_orchestrator_eval_accuracy{set="NAME"}. Names: lower-case letters, digits and _."""
    samples: int = Field(0, ge=0)
    """Sampled evals beside the greedy ones: k samples per eval prompt at `temperature`, scored
    as pass@k and mean@k in eval.jsonl (0 = greedy only)."""
    temperature: float = Field(1.0, gt=0)
    """Temperature of the sampled evals (in [0.01, 100])."""
    reward: str = ""
    """The reward that scores eval rounds (a name or `module:function`, checked like `reward`).
    Empty: the training reward. A run trained on a model's verdicts (`judge:` / `reward_model:`)
    names here the rule that measures it, e.g. exact_match."""
    policy: bool = False
    """Every eval round also scores π, the trainer's weights as published and never quantised,
    greedily on every eval set, served by a replica of the `policy_eval` pool (`steadyrl run`
    starts one: inference.pool; compose's `policy-eval` profile and deploy/k8s/components/policy-eval
    add one): policy-eval.jsonl, the scalar `policy_eval_accuracy`, and in
    Prometheus steadyrl_orchestrator_policy_eval_accuracy{set} beside the first round's
    steadyrl_orchestrator_policy_eval_initial_accuracy{set} and the round before the last's
    steadyrl_orchestrator_policy_eval_previous_accuracy{set} (alert SteadyrlPolicyUnderStart). The
    evals above score μ, the model the replicas serve; under a quantised engine the two part."""

    @field_validator("temperature")
    @classmethod
    def _sane_temperature(cls, value: float) -> float:
        return check_temperature(value)

    @field_validator("reward")
    @classmethod
    def _eval_reward_serves(cls, value: str) -> str:
        return checked_reward(value)

    @field_validator("sets")
    @classmethod
    def _eval_set_names(cls, value: dict[str, Path]) -> dict[str, Path]:
        for name in value:
            if not EVAL_SET_NAME.fullmatch(name) or name == "main":
                raise ValueError(
                    f"eval set name {name!r}: lower-case letters, digits and _, and not 'main' "
                    "(the task's own eval set)"
                )
        return value


class TrajectorySettings(BaseModel):
    """Multi-turn rollouts ([orchestrator.trajectory])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    environment: str = ""
    """Multi-turn rollouts: the environment that plays every task — a registered name (`calc`), a
    plug-in `module:factory` importable by the replicas (`shared.envs`; its reward replaces
    `reward`), or `agent:COMMAND`, an agent program run per trajectory against the replica's
    OpenAI-compatible endpoint (inference.agent.endpoint), its last line of output scored by `reward`,
    or `verifiers:ENV_ID [{JSON kwargs}]`, a `verifiers` environment (the `verifiers` extra:
    `.venv/bin/pip install -e '.[verifiers]'` from the repository root; task `verifiers`: its
    dataset, its rollout loop, its rubric).
    Empty: the task's own (`calc` for calc, none — one prompt, one completion — otherwise)."""
    max_turns: int = Field(4, ge=1)
    """Multi-turn: model turns per trajectory at most."""
    max_tokens: int = Field(0, ge=0)
    """Multi-turn: completion tokens per trajectory at most, the model's and the environment's
    (0: max_new_tokens × max_turns). `max_new_tokens` bounds each model turn."""
    env_seconds: float = Field(10.0, gt=0)
    """Multi-turn: one environment call (reset or step) at most; past it the task is dead-lettered."""

    @field_validator("environment")
    @classmethod
    def _environment_known(cls, value: str) -> str:
        if value.startswith("agent:"):
            if not value[len("agent:") :].strip():
                raise ValueError("an agent environment names its command: agent:COMMAND")
        elif value.startswith("verifiers:"):
            from shared.envs import verifiers_adapter

            verifiers_adapter.load(value)
        elif value:
            from shared.envs import environment_factory

            try:
                environment_factory(value)
            except KeyError as exc:
                raise ValueError(str(exc.args[0])) from None
        return value


class SamplingSettings(BaseModel):
    """Sampling of training rollouts ([orchestrator.sampling])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float = 1.0
    """Sampling temperature of training rollouts: 0 (greedy) or in [0.01, 100] (shared/rollouts/sampling.py)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Top-p of training rollouts (1: the trainer's recompute sees the same distribution)."""
    max_new_tokens: int = Field(16, ge=1)
    """Completion budget."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's soft overlong punishment on training rollouts: a completion past max_new_tokens −
    overlong_buffer tokens loses overlong_penalty × its share of the buffer from its reward (all of
    it at the budget); 0: off. Less than max_new_tokens; single-turn tasks."""
    overlong_penalty: float = Field(1.0, ge=0, le=100)
    """The penalty at the token budget (DAPO: 1)."""

    @field_validator("temperature")
    @classmethod
    def _sane_temperature(cls, value: float) -> float:
        return check_temperature(value)

    @model_validator(mode="after")
    def _buffer_inside_the_budget(self) -> SamplingSettings:
        if self.overlong_buffer >= self.max_new_tokens:
            raise ValueError(
                f"overlong_buffer ({self.overlong_buffer}) must be less than max_new_tokens ({self.max_new_tokens})"
            )
        return self


class ControlSettings(BaseModel):
    """The HTTP control plane's bounds ([orchestrator.control])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    timeout_seconds: float = Field(2.0, gt=0, le=60)
    """Bound on the Redis work behind one control-plane request: past it, GET /v1/run answers the
    last status read (marked `stale`), a transition is refused with 503 and Retry-After (and is
    never applied later), gRPC answers UNAVAILABLE."""
    max_request_bytes: int = Field(1 << 20, ge=1024)
    """Largest HTTP request body accepted; a larger one is refused with 413 before it is read whole."""


class OrchestratorSettings(ServiceSettings, RedisSettings, StepShape):
    model_config = SettingsConfigDict(env_prefix="STEADYRL_ORCHESTRATOR_", env_nested_delimiter="__", extra="forbid")

    host: str = "127.0.0.1"
    """Address the HTTP control plane and the gRPC server bind to."""
    http_port: int = Field(8080, ge=0, le=65535)
    """FastAPI control plane (OpenAPI docs at /docs, Prometheus at /metrics)."""
    grpc_port: int = Field(50054, ge=0, le=65535)
    """gRPC Orchestrator service (Heartbeat, Status)."""
    token: SecretStr | None = None
    """Bearer token required on every route but /health and /metrics (never logged)."""
    token_file: Path | None = None
    """File holding the token (alternative to `token`)."""
    run_id: str = "default"
    """The run this orchestrator owns."""
    model_path: str
    """Model directory (its tokenizer turns prompts into token ids)."""
    out_dir: Path = Path("runs/orchestrator")
    """Where eval.jsonl is written."""
    tensorboard: bool = True
    """Write each eval round's accuracy as the TensorBoard scalar `eval_accuracy` (`out_dir/tensorboard/`)."""
    tracking: TrackingSettings = TrackingSettings()
    """W&B / MLflow, the scalars TensorBoard gets (a recipe sets [run.tracking])."""
    trainer_address: str = ""
    """host:port of the trainer's gRPC API (its version drives admission)."""
    steps: int = Field(0, ge=0)
    """Global steps of the run (0 = until stopped)."""
    stop: StopRules = StopRules()
    """When a run that can only fail is failed (services/orchestrator/stop_rules.py)."""
    reward: str = ""
    """The reward of every task: a built-in name (exact_match, math_verify, ...) or a plug-in
    `module:function(completion, answer) -> float` importable by the replicas, or a judge pool's
    `judge:NAME` / `reward_model:NAME` (template NAME of inference.judge.templates; docs/guides/pools.md).
    Checked before the run starts: loaded, its signature, one dry call in a reward process with a
    time limit. Empty: the task's own (exact_match for arith and mul_trace, math_verify for math)."""
    max_attempts: int = Field(3, ge=1)
    """A task whose lease expired or failed more often goes to the dead-letter stream."""
    tick_seconds: float = Field(0.1, gt=0)
    """Period of the admission / lease sweep loop."""
    lookahead_batches: int = Field(1, ge=0)
    """Batches queued beyond the staleness budget, each for a version the trainer has not made
    yet (the task's minimum version): a replica leases them ahead and starts them the moment their
    version lands, with no admission tick between. The staleness bound is unchanged."""
    autostart: bool = False
    """Start the run as soon as the orchestrator is up (else it waits in `created` for
    POST /v1/run/start)."""
    data: DataSettings = DataSettings()
    """The prompts ([orchestrator.data])."""
    evals: EvalSettings = EvalSettings()
    """Eval rounds ([orchestrator.evals])."""
    trajectory: TrajectorySettings = TrajectorySettings()
    """Multi-turn rollouts ([orchestrator.trajectory])."""
    sampling: SamplingSettings = SamplingSettings()
    """Sampling of training rollouts ([orchestrator.sampling])."""
    control: ControlSettings = ControlSettings()
    """The control plane's bounds ([orchestrator.control])."""

    @field_validator("reward")
    @classmethod
    def _reward_serves(cls, value: str) -> str:
        return checked_reward(value)

    _refuse_moved = refuse_moved("orchestrator")

    @model_validator(mode="after")
    def _task_and_environment(self) -> OrchestratorSettings:
        task, environment = self.data.task, self.trajectory.environment
        if self.data.mixture and environment.startswith("verifiers:"):
            raise ValueError(
                f"a data.mixture cannot be played by {environment!r}: a verifiers environment plays the whole "
                "run with its own dataset"
            )
        if (task == "verifiers") != environment.startswith("verifiers:"):
            raise ValueError(
                "data.task 'verifiers' and a trajectory.environment `verifiers:ENV_ID` go together (the "
                f"environment's dataset is the task's): task {task!r}, environment {environment!r}"
            )
        return self

    @model_validator(mode="after")
    def _source_names_free(self) -> OrchestratorSettings:
        clash = sorted({source.name for source in self.data.mixture} & set(self.evals.sets))
        if clash:
            raise ValueError(f"{clash}: both a mixture source and an evals.sets name (each names one eval set)")
        return self

    def environment_of(self, data: DataSource) -> str:
        """The environment that plays the tasks of source `data` ('' for single-turn ones)."""
        return self.trajectory.environment or ("calc" if data.task == "calc" else "")

    def check_dataset(self) -> None:
        """ValueError naming a missing dataset file or column of any source or eval set (`steadyrl run`
        calls it before any process starts; the files may live only where the orchestrator runs).
        The evals.sets are read with the first source's columns."""
        from shared.tasks.math_task import check_columns

        sources = self.data.sources()
        for data in sources:
            for path in [data.math_path, data.math_eval_path] if data.task == "math" else []:
                if path is not None:
                    check_columns(path, data.prompt_column, data.answer_column)
        for path in self.evals.sets.values():
            check_columns(path, sources[0].prompt_column, sources[0].answer_column)

    def bearer_token(self) -> str | None:
        """This setting, else the deployment's token (STEADYRL_TOKEN_FILE / STEADYRL_TOKEN) that gRPC uses."""
        from shared.rpc.secret_files import read_secret, refuse_empty, refuse_placeholder

        if self.token_file is not None:
            return read_secret(self.token_file, "the control plane's token, token_file")
        if self.token is not None:  # set, even empty: an empty token would turn the check off
            what = "the control plane's token, token"
            return refuse_placeholder(refuse_empty(self.token.get_secret_value().strip(), what), what)
        from shared.rpc.auth import token_from_env

        return token_from_env()
