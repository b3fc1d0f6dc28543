"""FP8 inference as an emulation: the weights of the linear layers are quantised to float8 e4m3
with one scale per output channel (amax / 448) when a version is loaded, and the model computes
on the dequantised values. On a CPU this reproduces FP8's rounding of the weights — the part of
an FP8 engine that moves its logprobs and routing away from the trainer's — but not FP8 kernels.
With `FP8Activations` the inputs of those matmuls are rounded too (W8A8, dynamic per-token
scales), as an FP8 engine's are; without it activations stay in the engine's dtype. The torch
engine applies them."""

from __future__ import annotations

import torch
from torch import nn

from shared.models.routing import ROUTER_RULES

QUANTIZATIONS = ("none", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def fp8_roundtrip(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [..., out, in] through e4m3 with a per-output-channel scale, back in its dtype."""
    w = weight.float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return ((w / scale).to(FP8).float() * scale).to(weight.dtype)


def fp8_targets(model: nn.Module, router: bool = False) -> list[str]:
    """Names of the parameters an FP8 engine stores in FP8: the weights of attention and MLP
    linears and the experts' stacked matrices; the router's only with `router`. Embeddings,
    norms and the output head stay in the engine's dtype, as in vLLM's fp8 scheme."""
    names: list[str] = []
    for prefix, module in model.named_modules():
        is_router = type(module).__name__ in ROUTER_RULES
        for name, param in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if full.startswith("lm_head") or param.dim() < 2 or isinstance(module, nn.Embedding):
                continue
            if is_router and not router:
                continue
            names.append(full)
    return names


@torch.no_grad()
def quantize_fp8_(model: nn.Module, names: list[str]) -> None:
    """Round the named parameters through FP8 in place."""
    params = dict(model.named_parameters())
    for name in names:
        params[name].copy_(fp8_roundtrip(params[name]))


def _grouped_mm_functions() -> tuple:
    """The grouped matmuls an MoE's experts run through (transformers' default `grouped_mm`
    experts: torch's kernel, or transformers' own loop where torch has none); `eager` experts
    call `linear` on slices instead."""
    import transformers.integrations.moe  # noqa: F401 - registers torch.ops.transformers.grouped_mm_fallback

    found = [getattr(nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None),
             getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)]
    return tuple(f for f in found if f is not None)


class FP8Activations(torch.overrides.TorchFunctionMode):
    """W8A8: while active (modes are per thread: enter it on the thread that runs the forward),
    every matmul whose weight is one of `weights` gets its input rounded through e4m3 with a
    dynamic scale per row (amax of the row / 448), as an FP8 engine quantises activations before
    its FP8 matmul: a `linear` on an FP8 parameter or on a slice of one (an expert of a stacked
    tensor, `eager` experts), and a grouped matmul on a view of one (`grouped_mm` experts, whose
    input rows are the tokens routed to each expert). Other matmuls (the output head, a router
    kept in full precision) are left alone. `matched` holds the weights whose inputs were rounded
    so far (by storage), so a test can check that every FP8 weight was reached."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {w.untyped_storage().data_ptr() for w in weights}
        self.matched: set[int] = set()
        self.grouped = _grouped_mm_functions()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and (func is nn.functional.linear or func in self.grouped):
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            storage = weight.untyped_storage().data_ptr() if weight is not None else None
            if storage in self.storages:
                self.matched.add(storage)
                return self.fp8_matmul(func, args, kwargs)
        return func(*args, **kwargs)

    def fp8_matmul(self, func, args: tuple, kwargs: dict):
        """One matmul on an FP8 weight: its input rounded through e4m3, then the matmul as asked."""
        return func(fp8_roundtrip(args[0]), *args[1:], **kwargs)
