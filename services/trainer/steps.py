"""The trainer's model side (`StepRunner`): the model, data parallelism, the optimizer, the recipe,
one global step, checkpoints. No Redis, no gRPC.

Data parallel: rank 0 broadcasts each global batch (protobuf bytes) to the other ranks, which
train the same batch (`follow`) until rank 0 says stop.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from services.trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from services.trainer.config import TrainerSettings
from shared.batch import collate
from shared.distributed import broadcast_payloads, init_from_env
from shared.models import load_causal_lm
from shared.models.routing import RoutingController
from shared.rollout import Rollout, RolloutLimits, decode_rollout, encode_rollout
from shared.torch_threads import bind_torch_threads
from shared.training import StepConfig, resolve_recipe, train_step

log = logging.getLogger("steadyrl.trainer")


def choose_recipe(settings: TrainerSettings, staleness_max: int, has_traces: bool,
                  is_moe: bool) -> tuple[StepConfig, str, str]:
    """The step's settings from the recipe: (config, name, why). Pure."""
    s = settings
    if s.recipe == "auto":
        replay, clip, why = resolve_recipe(s.mini_batches, staleness_max, has_traces)
        if not is_moe:
            replay, why = "off", why + " (dense model: no replay)"
    else:
        replay, clip, why = s.routing_replay, s.loss.clip, "manual"
    if s.bypass and replay == "r2":
        replay, why = "off", why + " (bypass: no recompute to replay, R2 off)"
    name = f"{s.loss.objective}{'+tis' if s.loss.train_infer_is else ''}{'+clip' if clip else ''}" + \
        (f"+{replay}" if replay != "off" else "")
    return s.step_config(replay, clip), name, why


class StepRunner:
    def __init__(self, settings: TrainerSettings) -> None:
        self.settings = settings
        torch.manual_seed(settings.seed)
        bind_torch_threads(settings.torch_threads)
        self.model = load_causal_lm(settings.model_path, "float32").train()
        self.routing = RoutingController(self.model)
        self.rank, self.world = init_from_env()
        self.parallel = torch.nn.parallel.DistributedDataParallel(self.model) if self.world > 1 else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, betas=settings.adam_betas,
                                           weight_decay=settings.weight_decay)
        config = self.model.config
        self.pad_token_id = int(getattr(config, "pad_token_id", None) or 0)
        context = int(getattr(config, "max_position_embeddings", 0) or 0) or RolloutLimits.max_total_tokens
        self.limits = RolloutLimits(
            max_encoded_bytes=settings.max_rollout_bytes, max_total_tokens=context, vocab_size=int(config.vocab_size),
            num_layers=self.routing.num_layers or None, top_k=self.routing.top_k or None,
            num_experts=self.routing.num_experts or None,
        )
        self.recipe = ""
        self.checkpoints = settings.out_dir / "checkpoints"

    def restore(self) -> TrainerState:
        found = latest_checkpoint(self.checkpoints)
        if found is None:
            return TrainerState()
        state = load_checkpoint(found, self.model, self.optimizer)
        log.info("event=resumed checkpoint=%s step=%d version=%d consumed=%d", found.name, state.step, state.version,
                 len(state.consumed))
        return state

    def save(self, state: TrainerState) -> Path:
        return save_checkpoint(self.checkpoints, self.model, self.optimizer, state, self.settings.keep_checkpoints)

    def weights(self) -> dict[str, torch.Tensor]:
        """What a version publishes."""
        return self.model.state_dict()

    def step(self, rollouts: list[Rollout], version: int) -> dict[str, float]:
        """One global step on whole groups (ordered by group, then sample index)."""
        if self.world > 1:  # the other ranks train on the same global batch (see follow)
            broadcast_payloads([encode_rollout(r) for r in rollouts], version)
        return self._step(rollouts, version)

    def _step(self, rollouts: list[Rollout], version: int) -> dict[str, float]:
        bind_torch_threads(self.settings.torch_threads)  # steps run on executor threads
        batch = collate(rollouts, self.pad_token_id)
        staleness_max = int((version - batch.versions[batch.loss_mask]).clamp(min=0).max()) \
            if batch.loss_mask.any() else 0
        config, recipe, why = choose_recipe(self.settings, staleness_max, batch.trace is not None,
                                            self.routing.is_moe)
        if recipe != self.recipe:
            log.info("event=recipe recipe=%s why=%s", recipe, why)
            self.recipe = recipe
        return train_step(self.parallel, self.optimizer, self.routing, batch, self.settings.group_size, config,
                          version, self.rank, self.world)

    def follow(self) -> int:
        """Ranks > 0: train each batch rank 0 broadcasts, until it stops."""
        steps = 0
        while True:
            payloads, version = broadcast_payloads(None)
            if payloads is None:
                return steps
            self._step([decode_rollout(p) for p in payloads], version)
            steps += 1

    def stop_followers(self) -> None:
        if self.world > 1 and self.rank == 0:
            broadcast_payloads(None)
