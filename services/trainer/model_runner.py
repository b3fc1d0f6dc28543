"""The trainer's model side (`StepRunner`): the model on its ranks, the optimizer, the recipe,
one global step, checkpoints, the weights a version publishes. No Redis, no gRPC.

Data parallel: rank 0 broadcasts each command to the other ranks, which follow (`follow`): a
global batch to train (protobuf bytes), a checkpoint to write (each rank its own shards), the
published weights to gather, or stop.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from services.trainer.batch import collate
from services.trainer.checkpoint import (
    TrainerState,
    finish_save,
    flat_state,
    is_sharded_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_sharded,
    staging_dir,
    start_save,
)
from services.trainer.config import TrainerSettings
from services.trainer.forward import Compute
from services.trainer.global_step import StepConfig, StepNotApplied, resolve_objective, resolve_recipe, train_step
from services.trainer.parallel import (
    GatheredView,
    gather_published,
    load_state,
    prepare,
    prepare_reference,
    wants_bf16,
)
from services.trainer.past_versions import PastVersions
from shared.core.lr_schedule import lr_factor
from shared.core.stats import StepStats
from shared.models import batch_invariant, load_causal_lm
from shared.models.loading import resolve_dtype
from shared.models.lora import (
    ADAPTER,
    adapter_config_json,
    adapter_state,
    apply_lora,
    base_digest,
    merged_state,
)
from shared.models.routing import RoutingController
from shared.rollouts.record import Rollout, RolloutLimits, decode_rollout, encode_rollout
from shared.rpc.steadyrl.v1.weightsync_pb2 import AdapterInfo
from shared.runtime.distributed import broadcast_payloads, init_from_env, rank_device
from shared.runtime.torch_threads import bind_torch_threads
from shared.weightsync.manifest import CastView

log = logging.getLogger("steadyrl.trainer")
SAVE = -2
GATHER = -3  # broadcast tags of the checkpoint and gather commands (a step's tag is its version, >= 0)


@dataclass
class PendingSave:
    """A checkpoint whose shards are being written (`future`: None when blocking). `finish` waits
    for every rank's shards, then (rank 0) puts the checkpoint in place — once: a caller cancelled
    while it ran (a Checkpoint request past its deadline) and a later caller get the same result."""

    directory: Path  # this attempt's staging directory
    state: TrainerState | None  # a copy as of the save (rank 0; None on the other ranks)
    param_groups: list
    keep: int
    future: Future | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    placed: Path | None = None
    finished: bool = False

    def done(self) -> bool:
        return self.finished or self.future is None or self.future.done()

    def finish(self) -> Path | None:
        with self.lock:
            if not self.finished:
                if self.future is not None:
                    self.future.result()
                if self.state is not None:
                    self.placed = finish_save(self.directory, self.state, self.param_groups, self.keep)
                self.finished = True
            return self.placed


def choose_recipe(
    settings: TrainerSettings, staleness_peak: int, has_traces: bool, is_moe: bool
) -> tuple[StepConfig, str, str]:
    """The step's settings from the recipe: (config, name, why). Pure."""
    s = settings
    objective = s.loss.objective
    if s.recipe == "auto":
        replay, clip, why = resolve_recipe(s.mini_batches, staleness_peak, has_traces)
        if not is_moe:
            replay, why = "off", why + " (dense model: no replay)"
        objective, because = resolve_objective(objective, s.max_staleness)
        why += f"; {because}" if because else ""
    else:
        replay = s.routing_replay
        clip = s.loss.clip
        why = "manual"
    if s.bypass and replay == "r2":
        replay, why = "off", why + " (bypass: no recompute to replay, R2 off)"
    if s.exact:
        why += (
            "; exact: π equals μ bit for bit, every IS weight is 1 (the correction is the identity)"
            if staleness_peak == 0
            else "; exact: no mismatch, the IS weights correct the staleness alone"
        )
    name = f"{objective}{'+tis' if s.loss.train_infer_is else ''}{'+clip' if clip else ''}" + (
        f"+{replay}" if replay != "off" else ""
    )
    if s.distill.enabled:  # what the paper's recipe leaves out, named when a recipe adds it
        name += "+distill" + (f"_top{s.distill.top_k}" if s.distill.top_k and s.distill.top_k_coef else "")
    if s.loss.kl_coef:
        name += f"+kl_{s.loss.kl_estimator}_in_{s.loss.kl_in}"
    if s.loss.entropy_coef:
        name += "+entropy"
    if s.dynamic_sampling.enabled:
        name += "+dynamic_sampling"
    if s.exact:
        name += "+exact"
    return s.step_config(replay, clip, objective), name, why


class StepRunner:
    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = s = settings
        torch.manual_seed(s.seed)
        bind_torch_threads(s.compute.torch_threads)
        self.device = rank_device(s.compute.device)
        self.rank, self.world = init_from_env(self.device, s.parallel.collective_timeout_seconds)
        self.model = load_causal_lm(s.model_path, "float32")
        if s.exact:  # the replicas' batch-invariant forwards (checked on the step's thread: _step)
            batch_invariant.prepare(self.model)
        self.kernels_checked = not s.exact
        if s.lora.rank:  # the adapter trains, the base (router included) stays frozen
            self.model = apply_lora(
                self.model, s.lora.rank, s.lora.alpha, s.lora.dropout, s.lora.target_modules, s.lora.target_experts
            )
        self.routing = RoutingController(self.model)
        self.parallel = prepare(self.model, s, self.device, self.world)
        self.reference = (  # a KL term's frozen π_ref: loaded once, never trained nor checkpointed
            prepare_reference(load_causal_lm(s.reference_model or s.model_path, "float32"), s, self.device, self.world)
            if s.loss.kl_coef > 0
            else None
        )
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=s.optim.lr,
            betas=s.optim.adam_betas,
            weight_decay=s.optim.weight_decay,
        )
        bf16 = wants_bf16(s, self.device)
        sharded = s.parallel.mode in ("fsdp", "hsdp") and self.world > 1
        self.compute = Compute(
            self.device,
            torch.bfloat16 if bf16 and not sharded else None,
            s.compute.micro_batch_tokens,
            s.exact,
            shared_prefix=s.compute.shared_prefix,
        )
        self.sharded = sharded
        # exact mode: the last max_staleness versions' weights, to check the tokens they sampled
        self.past = PastVersions(s.model_path, s.max_staleness, self.compute) if s.exact else None
        self.publish_dtype = resolve_dtype(s.publish.dtype)
        config = self.model.config
        self.pad_token_id = int(getattr(config, "pad_token_id", None) or 0)
        context = int(getattr(config, "max_position_embeddings", 0) or 0) or RolloutLimits.max_total_tokens
        self.limits = RolloutLimits(
            max_encoded_bytes=s.stream.max_rollout_bytes,
            max_total_tokens=context,
            vocab_size=int(config.vocab_size),
            num_layers=self.routing.num_layers or None,
            top_k=self.routing.top_k or None,
            num_experts=self.routing.num_experts or None,
        )
        self.recipe = ""
        self.steps_done = 0  # global steps trained, restored from a checkpoint: the schedule's clock
        self.checkpoints = s.out_dir / "checkpoints"
        # async saves collect over a group of their own (a CPU one, as DCP asks), off the step's
        self.checkpoint_group = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=s.parallel.collective_timeout_seconds))
            if self.world > 1
            else None
        )
        self.saving: PendingSave | None = None  # the ranks > 0's save under way
        log.info(
            "event=trainer_layout rank=%d world=%d device=%s precision=%s parallel=%s micro_batch_tokens=%d "
            "activation_checkpointing=%s",
            self.rank,
            self.world,
            self.device,
            "bf16-mixed" if bf16 else "fp32",
            s.parallel.mode if self.world > 1 else "single",
            s.compute.micro_batch_tokens,
            s.compute.activation_checkpointing,
        )

    def restore(self) -> TrainerState:
        """The newest checkpoint into the model and optimizer (every rank calls this)."""
        found = latest_checkpoint(self.checkpoints)
        if found is None:
            return TrainerState()
        if is_sharded_checkpoint(found):  # every rank reads its part, resharded to this world
            state = load_sharded(found, self.model, self.optimizer)
        else:  # the earlier full-state format; sharded: rank 0 reads, the others receive
            reader = self.rank == 0 or not self.sharded
            # the others' step (the schedule counts from it) is the checkpoint's name, step-00000012
            unread = ({}, {}, TrainerState(step=int(found.name.removeprefix("step-"))))
            model_state, optimizer_state, state = load_checkpoint(found) if reader else unread
            load_state(self.model, self.optimizer, model_state, optimizer_state)
        self.steps_done = state.step
        log.info(
            "event=resumed checkpoint=%s step=%d version=%d consumed=%d",
            found.name,
            state.step,
            state.version,
            len(state.consumed),
        )
        return state

    def save(self, state: TrainerState) -> PendingSave:
        """Rank 0: start a checkpoint of `state` (every rank writes its own shards; the caller
        finishes the previous one first). Returns once the shards are staged (async) or written."""
        attempt = uuid.uuid4().hex[:12]
        if self.world > 1:
            broadcast_payloads([f"{state.step}:{attempt}".encode()], SAVE)
        return self._save(
            state.step, attempt, TrainerState(state.step, state.version, set(state.consumed), dict(state.counters))
        )

    def _save(self, step: int, attempt: str, state: TrainerState | None) -> PendingSave:
        flat, param_groups = flat_state(self.model, self.optimizer)
        directory = staging_dir(self.checkpoints, step, attempt)
        future = start_save(
            directory,
            flat,
            self.checkpoint_group,
            self.settings.checkpoint.async_save,
            self.settings.checkpoint.file_bytes,
        )
        if self.settings.lora.rank and self.rank == 0:  # the adapter's shape, as peft writes it
            self.model.peft_config[ADAPTER].save_pretrained(str(directory))
        return PendingSave(directory, state, param_groups, self.settings.checkpoint.keep, future)

    def weights(self) -> Mapping[str, torch.Tensor]:
        """What the current version publishes, in the published dtype, one tensor at a time: a cast
        view of the model, or of a sharded one gathered tensor by tensor as the transport reads it
        (the other ranks gather with it). Call with no step running."""
        lora = self.settings.lora
        info = (
            AdapterInfo(base_digest=base_digest(self.settings.model_path), config_json=adapter_config_json(self.model))
            if lora.rank and lora.publish == "adapter"
            else None
        )  # the adapter alone
        if lora.rank and info is None:  # the base with the adapter merged in, under the base's names
            return CastView(merged_state(self.model), self.publish_dtype)
        if not self.sharded:
            return CastView(self.published(), self.publish_dtype, info)
        return GatheredView(self.published(), self.publish_dtype, lambda: broadcast_payloads([], GATHER), info)

    def published(self) -> Mapping[str, torch.Tensor]:
        """The tensors a version holds: the model's state dict, or its LoRA adapter's (sharded or not)."""
        return adapter_state(self.model) if self.settings.lora.rank else self.model.state_dict()

    def step(self, rollouts: list[Rollout], version: int) -> dict[str, float]:
        """One global step on whole groups (ordered by group, then sample index); NonFiniteStep
        when it was not applied (the model and optimizer untouched)."""
        if self.world > 1:  # the other ranks train on the same global batch (see follow)
            broadcast_payloads([encode_rollout(r) for r in rollouts], version)
        return self._step(rollouts, version)

    def _step(self, rollouts: list[Rollout], version: int) -> dict[str, float]:
        bind_torch_threads(self.settings.compute.torch_threads)  # steps run on executor threads
        if not self.kernels_checked:  # exact mode: on the kernels and thread count the steps use
            batch_invariant.check_kernels(self.model, self.device)
            self.kernels_checked = True
        started = time.perf_counter()
        batch = collate(rollouts, self.pad_token_id, self.settings.mask_truncated)
        collate_seconds = time.perf_counter() - started
        staleness_peak = (
            int((version - batch.versions[batch.loss_mask]).clamp(min=0).max()) if batch.loss_mask.any() else 0
        )
        config, recipe, why = choose_recipe(self.settings, staleness_peak, batch.trace is not None, self.routing.is_moe)
        if recipe != self.recipe:
            log.info("event=recipe recipe=%s why=%s", recipe, why)
            self.recipe = recipe
        optim = self.settings.optim
        lr = optim.lr * lr_factor(
            self.steps_done, self.settings.max_steps, optim.schedule, optim.warmup_steps, optim.min_lr_ratio
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        past = StepStats()
        if self.past is not None:  # the tokens older versions sampled, under those versions
            self.past.check(batch, version, past)
            self.past.remember(version, self.model)
        metrics = train_step(
            self.parallel,
            self.optimizer,
            self.routing,
            batch,
            self.settings.group_size,
            config,
            version,
            self.rank,
            self.world,
            self.compute,
            self.reference,
        )
        self.steps_done += 1
        if self.past is not None:
            checked = past.result()
            metrics["exact_tokens"] += checked.get("exact_tokens", 0.0)
            metrics["exact_unchecked_tokens"] = checked.get("exact_unchecked_tokens", 0.0)
        metrics["collate_seconds"] = collate_seconds
        metrics["lr"] = lr
        metrics["truncated_frac"] = sum(r.finish_reason == "length" for r in rollouts) / len(rollouts)
        return metrics

    def follow(self) -> int:
        """Ranks > 0: follow rank 0's commands — train a batch, join a checkpoint — until stop."""
        steps = 0
        while True:
            payloads, tag = broadcast_payloads(None)
            if payloads is None:
                return steps
            if tag == SAVE:
                if self.saving is not None:  # rank 0 finished it before asking for the next
                    self.saving.finish()
                step, attempt = payloads[0].decode().split(":")
                self.saving = self._save(int(step), attempt, None)
                continue
            if tag == GATHER:
                gather_published(self.published())
                continue
            try:
                self._step([decode_rollout(p) for p in payloads], tag)
            except StepNotApplied:  # every rank decided it alike: rank 0 settles its rollouts
                continue
            steps += 1

    def stop_followers(self) -> None:
        if self.world > 1 and self.rank == 0:
            broadcast_payloads(None)
