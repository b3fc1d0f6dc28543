"""MoE routing capture and replay (Routing Replay, paper §3.2) for Hugging Face MoE models.

A `RoutingController` hooks the top-k router of every MoE layer; per forward it is off, capturing (records the top-k
expert ids) or replaying (forces given ids). Replay fixes the indices only: the gate weights are recomputed from this
forward's router logits, so the router still receives gradient. Traces are int tensors [B, T, layers, top_k].

Details: docs/internals/engines.md"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn


class NotMoEError(ValueError):
    """The model has no MoE router, so it has no routing to capture or replay."""


@dataclass(frozen=True)
class RouterRule:
    """How an architecture turns router logits at the chosen experts into gate weights."""

    renormalize: bool | None  # None: read the router's `norm_topk_prob`
    cast_to_logits_dtype: bool


# transformers' router classes and their gate-weight rule (see each modeling_*.py).
ROUTER_RULES: dict[str, RouterRule] = {
    "Qwen3MoeTopKRouter": RouterRule(renormalize=None, cast_to_logits_dtype=True),
    "Qwen2MoeTopKRouter": RouterRule(renormalize=None, cast_to_logits_dtype=True),
    "OlmoeTopKRouter": RouterRule(renormalize=None, cast_to_logits_dtype=True),
    "MixtralTopKRouter": RouterRule(renormalize=True, cast_to_logits_dtype=False),
}


def gate_weights(router: nn.Module, rule: RouterRule, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gate weights at `indices` [N, K] from router logits [N, E]: softmax → gather → renormalise."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, indices)
    renormalize = rule.renormalize if rule.renormalize is not None else bool(router.norm_topk_prob)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype) if rule.cast_to_logits_dtype else weights


@dataclass
class Recording:
    """Expert ids recorded per layer during capture: one [N, K] tensor per router call."""

    num_layers: int
    calls: list[list[torch.Tensor]] = field(default_factory=list)

    def trace(self, batch_shape: tuple[int, int] | torch.Size, call: int = -1) -> torch.Tensor:
        """The trace of the last forward (or of `call`, counted as a list index) as [B, T, layers, top_k] (int64)."""
        if len(self.calls) < abs(call) or len(self.calls[call]) != self.num_layers:
            raise RuntimeError("no complete forward was captured")
        per_layer = torch.stack(self.calls[call], dim=1)  # [N, L, K]
        batch, seq = batch_shape
        if per_layer.shape[0] != batch * seq:
            raise ValueError(f"captured {per_layer.shape[0]} tokens, batch shape {tuple(batch_shape)}")
        return per_layer.reshape(batch, seq, self.num_layers, -1)


class RoutingController:
    """Hooks every MoE router of `model`; `capture()` and `replay(trace)` select the mode."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.routers: list[tuple[nn.Module, RouterRule]] = [
            (module, ROUTER_RULES[type(module).__name__])
            for module in model.modules()
            if type(module).__name__ in ROUTER_RULES
        ]
        unknown = [type(m).__name__ for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        unknown = sorted(set(unknown) - set(ROUTER_RULES))
        if unknown:
            raise NotImplementedError(f"routers without a replay rule: {unknown}; add them to ROUTER_RULES")
        self._mode = "off"
        self._recording: Recording | None = None
        self._replay: torch.Tensor | None = None  # [N, L, K]
        self._replay_mask: torch.Tensor | None = None  # [N] bool
        self.replayed: list[torch.Tensor] = []  # per layer: the ids the last replayed forward used
        self._handles = [
            router.register_forward_hook(self._make_hook(layer, router, rule))
            for layer, (router, rule) in enumerate(self.routers)
        ]

    @property
    def mode(self) -> str:
        """ "off", "capture" or "replay"."""
        return self._mode

    @property
    def is_moe(self) -> bool:
        return bool(self.routers)

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return int(self.routers[0][0].top_k) if self.routers else 0

    @property
    def num_experts(self) -> int:
        return int(self.routers[0][0].num_experts) if self.routers else 0

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _require_moe(self) -> None:
        if not self.is_moe:
            raise NotMoEError(
                f"{type(self.model).__name__} has no MoE router: routing traces exist only for MoE models"
            )

    @contextlib.contextmanager
    def capture(self) -> Iterator[Recording]:
        """Record the top-k expert ids of every MoE layer for each forward inside the block."""
        self._require_moe()
        recording = Recording(self.num_layers)
        with self._mode_set("capture", recording=recording):
            yield recording

    @contextlib.contextmanager
    def replay(self, trace: torch.Tensor, mask: torch.Tensor | None = None) -> Iterator[None]:
        """Route by `trace` [B, T, layers, top_k] in every forward inside the block.

        `mask` [B, T] (bool) selects the replayed tokens; the others route freely (positions
        a trace does not cover, e.g. the last token or padding).
        """
        self._require_moe()
        if trace.dim() != 4 or trace.shape[2] != self.num_layers or trace.shape[3] != self.top_k:
            raise ValueError(f"trace shape {tuple(trace.shape)} does not fit [B, T, {self.num_layers}, {self.top_k}]")
        if trace.numel() and (int(trace.min()) < 0 or int(trace.max()) >= self.num_experts):
            raise ValueError(f"trace expert ids must lie in [0, {self.num_experts})")
        flat = trace.reshape(-1, self.num_layers, self.top_k).long()
        flat_mask = None if mask is None else mask.reshape(-1).bool()
        with self._mode_set("replay", replay=flat, replay_mask=flat_mask):
            yield

    @contextlib.contextmanager
    def _mode_set(self, mode: str, recording=None, replay=None, replay_mask=None) -> Iterator[None]:
        if self._mode != "off":
            raise RuntimeError(f"routing controller is already in {self._mode} mode")
        self._mode = mode
        self._recording = recording
        self._replay = replay
        self._replay_mask = replay_mask
        try:
            yield
        finally:
            self._mode = "off"
            self._recording = None
            self._replay = None
            self._replay_mask = None

    def _make_hook(self, layer: int, router: nn.Module, rule: RouterRule):
        def hook(module: nn.Module, args, output):
            if self._mode == "capture":
                assert self._recording is not None
                if layer == 0:
                    self._recording.calls.append([])
                self._recording.calls[-1].append(output[2].detach())
                return None
            if self._mode != "replay":
                return None
            logits, _, free_indices = output
            replay = self._replay
            assert replay is not None
            if replay.shape[0] != logits.shape[0]:
                raise ValueError(f"replay trace covers {replay.shape[0]} tokens, the forward has {logits.shape[0]}")
            indices = replay[:, layer, :].to(free_indices.device)
            if self._replay_mask is not None:
                keep = self._replay_mask.to(free_indices.device).unsqueeze(-1)
                indices = torch.where(keep, indices, free_indices)
            if layer == 0:
                self.replayed = []
            self.replayed.append(indices.detach())
            return logits, gate_weights(module, rule, logits, indices), indices

        return hook
