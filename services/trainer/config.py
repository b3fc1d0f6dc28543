"""Settings of the trainer (env prefix STEADYRL_TRAINER_)."""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from services.trainer.step_config import StepConfig
from shared.core.loss_config import LossConfig
from shared.core.lr_schedule import Schedule
from shared.rollouts.sampling import MAX_SCORE_TOP_K
from shared.runstore.redis_client import RedisSettings
from shared.runtime.moved_settings import refuse_moved
from shared.runtime.settings import ApiServiceSettings, StepShape, TrackingSettings, UnsignedWeights
from shared.weightsync.base import TransportName


class LoraSettings(BaseModel):
    """LoRA RL ([trainer.lora]): the trainer trains an adapter of this rank over the frozen base
    (the router frozen too: never a target); rank 0 trains every weight."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    rank: int = Field(0, ge=0)
    """Adapter rank (0: off, full fine-tuning)."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the update is alpha / rank × B A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (0 with target_experts: peft requires it)."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    """Linear layers adapted, by name suffix (peft's target_modules)."""
    target_experts: bool = False
    """Adapt the MoE experts too, where the architecture keeps them as stacked parameters
    (Qwen3-MoE in transformers 5: mlp.experts.gate_up_proj and down_proj)."""
    publish: Literal["adapter", "merged"] = "adapter"
    """What a version carries: the adapter alone (its tensors, config and the base's digest; the
    torch engine adds it to the base it serves in place, the vllm engine loads it through its LoRA
    support), or the base with the adapter merged in (a full version, any engine)."""

    @model_validator(mode="after")
    def _experts_without_dropout(self) -> LoraSettings:
        if self.target_experts and self.dropout:
            raise ValueError(
                "trainer.lora.dropout must be 0 with target_experts (peft adapts stacked experts without it)"
            )
        return self


class OptimSettings(BaseModel):
    """The optimizer ([trainer.optim]): AdamW."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, ge=0)
    """Max global gradient norm (0 = off)."""
    schedule: Schedule = "constant"
    """The learning rate over the run: `lr` throughout, or decaying from `lr` to `min_lr_ratio` × `lr`
    at the run's last step along a half cosine or a line (a decay needs run.steps)."""
    warmup_steps: int = Field(0, ge=0)
    """Global steps of linear warm-up to `lr` before the schedule (0 = none)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """A decaying schedule's last learning rate, as a share of `lr`."""

    @field_validator("adam_betas")
    @classmethod
    def _betas_below_one(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"trainer.optim.adam_betas must each lie in [0, 1) (AdamW's), got {list(betas)}")
        return betas


class ParallelSettings(BaseModel):
    """Data parallelism and the torchrun job ([trainer.parallel])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """A full model per rank (ddp), or parameters, gradients and optimizer state sharded over the
    ranks (fsdp: FSDP2 per decoder layer, then the root), or sharded within groups of
    `shard_ranks` and replicated across them (hsdp: FSDP2 on a 2-D mesh, replicate × shard)."""
    gpus: int = Field(0, ge=0)
    """GPUs per trainer node, one torchrun rank each (0 = the CPU)."""
    ranks: int = Field(0, ge=0)
    """torchrun ranks per node on the CPU when gpus = 0 (0 = one process)."""
    nodes: int = Field(1, ge=1)
    """Trainer nodes (torchrun --nnodes): above 1 the job launcher starts one torchrun per node
    (deploy/slurm, the JobSet of deploy/k8s), meeting at `rdzv_endpoint`; `steadyrl run` is one node."""
    rdzv_endpoint: str = ""
    """host:port of the weight-sync service, where the nodes meet (torchrun's `steadyrl` rendezvous:
    weight-sync's gRPC port, the deployment's token required; no store port is opened); needed when
    nodes > 1."""
    rdzv_id: str = Field("", max_length=200)
    """The job's name at the rendezvous, one per launch of the job (a requeued Slurm job, a restarted
    JobSet: a new one), so that no node meets one of an earlier launch; empty: run_id."""
    rdzv_timeout_seconds: int = Field(600, ge=1)
    """How long a node waits at the rendezvous for the others before its launcher fails."""
    max_restarts: int = Field(3, ge=0)
    """torchrun --max-restarts: how often a node's launcher restarts its ranks after one fails
    before the job itself fails."""
    shard_ranks: int = Field(0, ge=0)
    """hsdp: ranks per shard group (0 = the ranks of one node, torchrun's LOCAL_WORLD_SIZE); the
    world size must be a multiple of it."""
    collective_timeout_seconds: float = Field(600.0, gt=0)
    """Bound on one collective (the process group's timeout): a hung peer makes the rank exit, and
    torchrun restarts the ranks from the checkpoint."""

    @model_validator(mode="after")
    def _consistent(self) -> ParallelSettings:
        if self.gpus and self.ranks and self.ranks != self.gpus:
            raise ValueError(f"ranks ({self.ranks}) must equal gpus ({self.gpus}) on GPUs: one rank per GPU")
        if self.nodes > 1 and not _endpoint(self.rdzv_endpoint):
            raise ValueError(
                f"trainer.parallel.nodes = {self.nodes} needs trainer.parallel.rdzv_endpoint = 'host:port' (the "
                f"weight-sync service, where the nodes meet), got {self.rdzv_endpoint!r}"
            )
        per_node = self.gpus or self.ranks  # 0: the world is torchrun's, known at start (parallel.shard_layout)
        if self.mode == "hsdp" and self.shard_ranks and per_node and per_node * self.nodes % self.shard_ranks:
            raise ValueError(
                f"trainer.parallel.mode = 'hsdp': {per_node * self.nodes} ranks are not a whole number of "
                f"shard groups of trainer.parallel.shard_ranks = {self.shard_ranks}"
            )
        return self


class ComputeSettings(BaseModel):
    """Where and how each rank computes ([trainer.compute])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Each rank's device: auto = cuda:LOCAL_RANK when CUDA is visible, else the CPU."""
    precision: Literal["auto", "fp32", "bf16-mixed"] = "auto"
    """fp32, or bf16 compute over fp32 parameters, gradients and optimizer state (the loss math
    stays fp32); auto = bf16-mixed on CUDA, fp32 on the CPU."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Split each rank's mini-batch into micro-batches of at most this many tokens, gradients
    accumulated (the update is the unsplit one); 0 = no split."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them."""
    torch_threads: int = Field(0, ge=0)
    """torch intra-op threads (0 = torch's default)."""
    shared_prefix: bool = True
    """Compute each distinct prompt prefix of a batch once, its rows' remainders against its keys
    and values (one process, no routing replay, no activation checkpointing, not exact; elsewhere
    whole rows): the same forward to fp32 rounding, a third fewer positions on the demo."""


class CheckpointSettings(BaseModel):
    """Checkpoints ([trainer.checkpoint]): rollouts are acknowledged only once one holds them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    every: int = Field(1, ge=1)
    """Steps between checkpoints."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    file_bytes: int = Field(256 * 1024**2, ge=1024**2)
    """Each rank's shard is written as files of about this size (safetensors serialises a file in
    memory before writing it: this bounds what a save adds to a rank's memory)."""
    async_save: bool = True
    """Write the shards in the background (`dcp.async_save`: staged into host memory, written while
    the next steps train), its rollouts acknowledged once it is in place. False: the step waits."""


class PublishSettings(BaseModel):
    """How each version is published ([trainer.publish]; docs/security.md for the signing)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    signing_key_file: Path | None = None
    """The run's private Ed25519 key (64 hexadecimal characters, `steadyrl keys DIR` makes a pair):
    every version is signed with it, and weight-sync and the replicas take no other. Required to
    publish unless unsigned_weights; only the trainer holds it."""
    timeout_seconds: float = Field(600.0, gt=0)
    """Bound on one version push; a push that fails is retried on the next turn of the loop."""
    transport: TransportName = TransportName.GRPC
    """How each version's bytes reach the replicas (the signed manifest always goes through
    weight-sync): gRPC chunks, a shared-memory file (same host), or a torch.distributed broadcast."""
    shm_dir: Path = Path("/dev/shm/steadyrl")
    """shm: version files go to <shm_dir>/<run_id>/<run instance>/ (under the weight-sync service's shm_dir)."""
    shm_keep: int = Field(4, ge=1)
    """shm: version files kept (older ones are deleted; a reader keeps what it mapped)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype of the published weights: the replicas' (`steadyrl run` sets it from inference.dtype)."""
    patches: bool = False
    """shm, collective: a tensor travels as its changed elements since the last version published where
    that is at most half its bytes (the trainer keeps a copy of that version in the published dtype;
    so does each vLLM worker); a replica that holds other bytes takes the version whole from
    weight-sync. Fewer bytes (0.018 of a bf16 version at lr 1e-6), not fewer seconds on one host:
    docs/internals/weights.md. Not with a quantized torch engine."""


class StreamSettings(BaseModel):
    """Reading the rollout stream ([trainer.stream])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    read_block_ms: int = Field(200, ge=1)
    """XREADGROUP block time while waiting for rollouts."""
    max_rollout_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Larger stream entries go to the dead-letter stream."""
    dead_letter_maxlen: int = Field(10_000, ge=1)
    """Newest dead-lettered rollouts kept with their payload (every reason stays counted)."""


class DynamicSamplingSettings(BaseModel):
    """DAPO's dynamic sampling ([trainer.dynamic_sampling]): a group whose G rewards are all equal has
    zero advantage and teaches nothing, so it is not trained — acknowledged as filtered (the ledger's
    `trained:filtered`), and the orchestrator admits a task in its place, keeping every step's batch
    of informative groups full."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    """Filter groups with equal rewards (off: every group is trained, as in the paper)."""
    max_filtered_per_step: int = Field(0, ge=0)
    """At most this many groups filtered while one step's batch fills (0: batch_prompts, i.e. up to
    twice the groups sampled per trained step, DAPO's max_num_gen_batches = 2); past it a group with
    equal rewards is trained (a warning and steadyrl_trainer_dynamic_sampling_cap_hit_total), so a
    run whose tasks became all-solved still moves."""


class DistillSettings(BaseModel):
    """On-policy distillation ([trainer.distill]): every token's advantage is coef · (log π_teacher −
    log μ), the teacher pool's logprob against the sampler's, plus reward_weight · the task's
    advantage; with top_k, the loss adds top_k_coef · the KL from the teacher's distribution over
    its k most likely tokens (and one bucket for the rest) to the policy's at every position. Every
    rollout must carry what the teacher pool scored (a run with a [teacher] pool)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    coef: float = Field(0.0, ge=0)
    """Weight of the teacher's per-token signal (0: off, the task's reward alone)."""
    reward_weight: float = Field(0.0, ge=0)
    """Weight of the task's sequence advantage beside it (0: pure distillation)."""
    max_gap: float = Field(10.0, gt=0, allow_inf_nan=False)
    """Bound on each token's |log π_teacher − log μ| (finite): a token the teacher all but rules out
    would otherwise outweigh the whole batch."""
    top_k: int = Field(0, ge=0, le=MAX_SCORE_TOP_K)
    """The teacher's k most likely tokens at every position, carried on each rollout, and the
    distribution loss over them (0: off). Unlike the sampled token's log-ratio, its gradient does
    not fade where the policy is confidently wrong."""
    top_k_coef: float = Field(1.0, ge=0)
    """Weight of that loss (with top_k > 0)."""

    @property
    def enabled(self) -> bool:
        """Whether the run distils: a teacher signal in the advantages or in the loss."""
        return self.coef > 0 or (self.top_k > 0 and self.top_k_coef > 0)


class TrainerSettings(ApiServiceSettings, RedisSettings, StepShape, UnsignedWeights):
    model_config = SettingsConfigDict(env_prefix="STEADYRL_TRAINER_", env_nested_delimiter="__", extra="forbid")

    port: int = Field(50053, ge=0, le=65535)
    """gRPC port (0 = any free port)."""
    metrics_port: int = Field(9103, ge=0, le=65535)
    """Prometheus /metrics port (0 = any free port)."""
    model_path: str
    """Local Hugging Face model directory to start from (the checkpoint wins when one exists)."""
    out_dir: Path = Path("runs/trainer")
    """Checkpoints (`checkpoints/`), the per-step `metrics.jsonl` and its TensorBoard scalars (`tensorboard/`)."""
    tensorboard: bool = True
    """Write every metrics.jsonl key as a TensorBoard scalar under `out_dir/tensorboard/`."""
    tracking: TrackingSettings = TrackingSettings()
    """W&B / MLflow, every metrics.jsonl key per step (a recipe sets [run.tracking])."""
    stall_alert_seconds: float = Field(600.0, gt=0)
    """Exported as `steadyrl_trainer_stall_alert_seconds`: the SteadyrlTrainerStalled alert fires
    when no step has finished for this long (size it above the slowest expected step)."""
    run_id: str = "default"
    """Run whose rollout stream is trained on."""
    consumer: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    """Name of this trainer in the stream's consumer group."""
    weightsync_address: str = ""
    """host:port of the weight-sync service; empty = do not publish versions."""
    mini_batches: int = Field(1, ge=1)
    """N: optimizer steps per global step (1 = on-policy)."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many global steps (0 = run until stopped)."""
    seed: int = 0
    """Seed of torch's RNG (saved and restored with checkpoints)."""

    optim: OptimSettings = OptimSettings()
    """The optimizer ([trainer.optim])."""
    parallel: ParallelSettings = ParallelSettings()
    """Data parallelism and the torchrun job ([trainer.parallel])."""
    compute: ComputeSettings = ComputeSettings()
    """Device, precision, micro-batches ([trainer.compute])."""
    checkpoint: CheckpointSettings = CheckpointSettings()
    """Checkpoints ([trainer.checkpoint])."""
    publish: PublishSettings = PublishSettings()
    """Publishing versions ([trainer.publish])."""
    stream: StreamSettings = StreamSettings()
    """Reading rollouts ([trainer.stream])."""
    lora: LoraSettings = LoraSettings()
    """LoRA RL ([trainer.lora], `shared/models/lora.py`): rank > 0 trains an adapter over the frozen
    base; the optimizer and the checkpoints hold the adapter alone; each version publishes the
    adapter or the merged weights (`lora.publish`). Merged publishing needs one rank or DDP."""

    recipe: Literal["auto", "manual"] = "auto"
    """auto: replay and clipping from N and the observed staleness
    (`services.trainer.global_step.resolve_recipe`), and DPPO for MiniRL from max_staleness 4
    (`resolve_objective`: the objective arena); manual: as set (routing_replay, loss.clip, loss.objective)."""
    routing_replay: Literal["off", "r2", "r3"] = "off"
    """Manual recipe: routing replay mode."""
    advantage: Literal["mean", "std", "loo"] = "mean"
    """Group baseline."""
    bypass: bool = False
    """π_old := μ_old (no recompute forward)."""
    exact: bool = False
    """Exact mode (a recipe sets it with run.exact): batch-invariant fp32 forwards, the replicas' own, and
    every token sampled by the step's version checked bit for bit (docs/guides/exact.md)."""
    mask_truncated: bool = False
    """Truncated answers (finish reason "length": the token budget ran out before an end) leave the
    loss, as DAPO's overlong filtering does; their rewards still enter their group's advantages."""
    reference_model: str = ""
    """The frozen reference of a KL term (loss.kl_coef > 0): a local model directory, loaded once
    (under fsdp/hsdp sharded like the policy); empty: model_path, the run's starting weights."""
    distill: DistillSettings = DistillSettings()
    """On-policy distillation from a teacher pool ([trainer.distill], docs/guides/pools.md)."""
    dynamic_sampling: DynamicSamplingSettings = DynamicSamplingSettings()
    """DAPO's dynamic sampling: groups with equal rewards are filtered, not trained ([trainer.dynamic_sampling])."""
    loss: LossConfig = LossConfig()
    """The policy loss ([trainer.loss], STEADYRL_TRAINER_LOSS__<FIELD>; shared/core/loss_config.py `LossConfig`). Its
    `clip` is the manual recipe's; the auto recipe decides clipping itself."""

    _refuse_moved = refuse_moved("trainer")

    @model_validator(mode="after")
    def _consistent(self) -> TrainerSettings:
        if self.recipe == "manual":
            self.step_config(self.routing_replay, self.loss.clip)  # the step's own rules (e.g. R2 needs π_old)
        if self.mini_batches > self.batch_prompts:
            raise ValueError("mini_batches cannot exceed batch_prompts (mini-batches hold whole groups)")
        if self.dynamic_sampling.enabled and self.group_size < 2:
            raise ValueError(
                "trainer.dynamic_sampling filters groups whose rewards are all equal, and a group of "
                f"run.group_size = {self.group_size} always is: every group would be filtered and nothing "
                "trained. Set run.group_size >= 2 or turn dynamic sampling off"
            )
        parallel = self.parallel
        if (
            self.lora.rank
            and self.lora.publish == "merged"
            and parallel.mode != "ddp"
            and (parallel.gpus or parallel.ranks or parallel.nodes) > 1
        ):
            raise ValueError(
                f"trainer.lora.publish = 'merged' with trainer.parallel.mode = '{parallel.mode}' is not "
                "supported (the merge needs the whole weights on one rank): publish = 'adapter'"
            )
        if self.weightsync_address and self.publish.signing_key_file is None and not self.unsigned_weights:
            raise ValueError(
                "the trainer signs every version it publishes: set publish.signing_key_file (`steadyrl keys "
                "DIR` makes a pair), or unsigned_weights = true"
            )
        if self.exact:
            self._exact_fits()
        if self.optim.schedule != "constant" and not self.max_steps:
            raise ValueError(
                f"trainer.optim.schedule = '{self.optim.schedule}' decays to the run's last step: set run.steps"
            )
        if self.stream.read_block_ms >= self.redis_timeout_seconds * 1000:
            raise ValueError(
                "stream.read_block_ms must be shorter than redis_timeout_seconds (a blocked read would time out)"
            )
        return self

    def _exact_fits(self) -> None:
        """Exact mode computes as an exact replica does: one fp32 process, one thread on a CPU."""
        parallel, compute = self.parallel, self.compute
        refused = [
            (compute.precision == "bf16-mixed", "trainer.compute.precision = 'fp32' (the replicas sample in fp32)"),
            (
                compute.device != "cuda" and not parallel.gpus and compute.torch_threads != 1,
                "trainer.compute.torch_threads = 1",
            ),
            (compute.activation_checkpointing, "trainer.compute.activation_checkpointing = false"),
            (
                self.publish.dtype != "float32",
                "inference.dtype = 'float32' and trainer.publish.dtype = 'float32' (it follows inference.dtype)",
            ),
            (bool(self.lora.rank), "no trainer.lora"),
            ((parallel.gpus or parallel.ranks or parallel.nodes) > 1, "one trainer rank"),
        ]
        wanted = [need for bad, need in refused if bad]
        if wanted:
            raise ValueError(f"run.exact needs {'; '.join(wanted)}")

    @property
    def filter_cap(self) -> int:
        """Groups dynamic sampling may filter per step (0 when it is off)."""
        ds = self.dynamic_sampling
        return (ds.max_filtered_per_step or self.batch_prompts) if ds.enabled else 0

    def step_config(self, replay: str, clip: bool, objective: str = "") -> StepConfig:
        return StepConfig(
            loss=replace(self.loss, clip=clip, objective=objective or self.loss.objective),
            advantage=self.advantage,
            mini_batches=self.mini_batches,
            replay=replay,
            bypass=self.bypass,
            grad_clip=self.optim.grad_clip,
            distill_coef=self.distill.coef,
            distill_reward_weight=self.distill.reward_weight,
            distill_max_gap=self.distill.max_gap,
            distill_top_k_coef=self.distill.top_k_coef if self.distill.top_k else 0.0,
            exact=self.exact,
        )


def _endpoint(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
