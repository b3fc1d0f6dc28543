"""Settings of the trainer (env prefix STEADYRL_TRAINER_)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from shared.core.loss import LossConfig
from shared.redis_client import RedisSettings
from shared.rpc import DEFAULT_MAX_MESSAGE_BYTES
from shared.training import StepConfig


class TrainerSettings(RedisSettings):
    model_config = SettingsConfigDict(env_prefix="STEADYRL_TRAINER_", extra="forbid")

    host: str = "127.0.0.1"
    """Address the gRPC server binds to."""
    port: int = Field(50053, ge=0, le=65535)
    """gRPC port (0 = any free port)."""
    metrics_port: int = Field(9103, ge=0, le=65535)
    """Prometheus /metrics port (0 = any free port)."""
    model_path: str
    """Local Hugging Face model directory to start from (the checkpoint wins when one exists)."""
    out_dir: Path = Path("runs/trainer")
    """Checkpoints (`checkpoints/`) and the per-step `metrics.jsonl`."""
    run_id: str = "default"
    """Run whose rollout stream is trained on."""
    consumer: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    """Name of this trainer in the stream's consumer group."""
    weightsync_address: str = ""
    """host:port of the weight-sync service; empty = do not publish versions."""
    hmac_key_file: Path | None = None
    """Key file for signing weight manifests (must match the weight-sync service's)."""
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=64 * 1024)
    """Largest gRPC message."""
    publish_timeout_seconds: float = Field(600.0, gt=0)
    """Bound on one version push; a push that fails is retried on the next turn of the loop."""

    batch_prompts: int = Field(8, ge=1)
    """B: prompts (complete groups) per global step."""
    group_size: int = Field(8, ge=1)
    """G: samples per prompt."""
    mini_batches: int = Field(1, ge=1)
    """N: optimizer steps per global step (1 = on-policy)."""
    max_staleness: int = Field(1, ge=0)
    """Rollouts older than trainer version − max_staleness (any token) are dropped."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many global steps (0 = run until stopped)."""
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, ge=0)
    """Max global gradient norm (0 = off)."""
    seed: int = 0
    """Seed of torch's RNG (saved and restored with checkpoints)."""
    torch_threads: int = Field(0, ge=0)
    """torch intra-op threads (0 = torch's default)."""

    recipe: Literal["auto", "manual"] = "auto"
    """auto: replay and clipping from N and the observed staleness (DESIGN.md §3); manual: as set."""
    routing_replay: Literal["off", "r2", "r3"] = "off"
    """Manual recipe: routing replay mode."""
    objective: Literal["minirl", "grpo"] = "minirl"
    """Policy objective."""
    train_infer_is: bool = True
    """Apply the training–inference IS weight (False: the paper's ablation)."""
    tis_cap: float = Field(5.0, gt=0)
    """Truncation C of the IS weight."""
    is_level: Literal["token", "sequence"] = "token"
    """Token- or sequence-level truncated IS."""
    clip: bool = True
    """Manual recipe: MiniRL clipping mask / GRPO clip."""
    eps_low: float = 0.2
    """Lower clip range."""
    eps_high: float = 0.27
    """Upper clip range."""
    normalization: Literal["tokens", "sequence"] = "tokens"
    """tokens: divide by the mini-batch's valid tokens; sequence: length normalisation (ablation)."""
    rejection: Literal["none", "seq_mis", "geo", "icepop"] = "none"
    """Extra mismatch rejection."""
    advantage: Literal["mean", "std", "loo"] = "mean"
    """Group baseline."""
    bypass: bool = False
    """π_old := μ_old (no recompute forward)."""

    checkpoint_every: int = Field(1, ge=1)
    """Steps between checkpoints; rollouts are acknowledged only once a checkpoint holds them."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    read_block_ms: int = Field(200, ge=1)
    """XREADGROUP block time while waiting for rollouts."""
    max_rollout_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Larger stream entries go to the dead-letter stream."""
    dead_letter_maxlen: int = Field(10_000, ge=1)
    """Newest dead-lettered rollouts kept with their payload (every reason stays counted)."""

    @model_validator(mode="after")
    def _consistent(self) -> TrainerSettings:
        if self.recipe == "manual" and self.routing_replay == "r2" and self.bypass:
            raise ValueError("R2 replays the π_old recompute's routing: it needs bypass off")
        if self.mini_batches > self.batch_prompts:
            raise ValueError("mini_batches cannot exceed batch_prompts (mini-batches hold whole groups)")
        if self.read_block_ms >= self.redis_timeout_seconds * 1000:
            raise ValueError("read_block_ms must be shorter than redis_timeout_seconds (a blocked read would time out)")
        return self

    def loss_config(self, clip: bool | None = None) -> LossConfig:
        return LossConfig(
            objective=self.objective, train_infer_is=self.train_infer_is, tis_cap=self.tis_cap,
            is_level=self.is_level, clip=self.clip if clip is None else clip, eps_low=self.eps_low,
            eps_high=self.eps_high, normalization=self.normalization, rejection=self.rejection,
        )

    def step_config(self, replay: str, clip: bool) -> StepConfig:
        return StepConfig(loss=self.loss_config(clip), advantage=self.advantage, mini_batches=self.mini_batches,
                          replay=replay, bypass=self.bypass, grad_clip=self.grad_clip)
