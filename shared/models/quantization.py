"""Low-precision inference as an emulation: the linear layers' weights are rounded through a low-precision format
when a version is loaded, and the model computes on the dequantised values (the format's rounding, not its kernels).

- `fp8`: float8 e4m3, one scale per output channel (amax / 448), as vLLM's online fp8.
- `fp4`: NVFP4, e2m1 values in blocks of 16 inputs, each with an e4m3 scale, under one fp32 scale per matrix.

`QuantizedActivations` rounds the matmuls' inputs too (W8A8 / W4A4). The torch engine applies them.

Details: docs/internals/engines.md"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shared.models.routing import ROUTER_RULES

QUANTIZATIONS = ("none", "fp8", "fp4")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1's magnitudes
FP4_MAX = FP4_VALUES[-1]
FP4_BLOCK = 16  # NVFP4: one e4m3 scale per 16 consecutive inputs
TINY = torch.finfo(torch.float32).tiny


def fp8_roundtrip(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [..., out, in] through e4m3 with a per-output-channel scale, back in its dtype."""
    w = weight.float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=TINY) / FP8_MAX
    return ((w / scale).to(FP8).float() * scale).to(weight.dtype)


FORMATS = {  # what each quantization stores, as an engine's capabilities note says it
    "fp8": "fp8 e4m3 weights, per-channel scales",
    "fp4": "fp4 e2m1 weights (NVFP4: e4m3 scales per 16 inputs, an fp32 scale per matrix)",
}


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """`x` (float32, already scaled into [-6, 6]; beyond saturates) to the nearest e2m1 value,
    ties to the even code (the one whose mantissa bit is 0: 0, 1, 2, 4), as hardware converts."""
    values = torch.tensor(FP4_VALUES, device=x.device)
    midpoints = (values[1:] + values[:-1]) / 2
    magnitude = x.abs().clamp(max=FP4_MAX)
    down = torch.bucketize(magnitude, midpoints)
    up = torch.bucketize(magnitude, midpoints, right=True)
    return values[torch.where(down % 2 == 0, down, up)] * x.sign()


def fp4_roundtrip(x: torch.Tensor, scale_dims: tuple[int, ...] = (-2, -1)) -> torch.Tensor:
    """`x` [..., rows, in] through NVFP4, back in its dtype: blocks of 16 along the last dim (the
    last block zero-padded), each scaled by amax / 6 stored in e4m3 relative to a global fp32
    scale amax / (448 × 6) over `scale_dims` — the whole matrix for a weight, each row (token)
    for an activation."""
    shape = x.shape
    w = x.float()
    pad = (-shape[-1]) % FP4_BLOCK
    w = nn.functional.pad(w, (0, pad)) if pad else w
    glob = (w.abs().amax(dim=scale_dims, keepdim=True).clamp(min=TINY) / (FP8_MAX * FP4_MAX)).unsqueeze(-1)
    blocks = w.reshape(*w.shape[:-1], -1, FP4_BLOCK)
    scale = ((blocks.abs().amax(dim=-1, keepdim=True) / FP4_MAX / glob).to(FP8).float() * glob).clamp(min=TINY)
    out = (e2m1_round(blocks / scale) * scale).reshape(w.shape)[..., : shape[-1]]
    return out.to(x.dtype)


def roundtrip(quantization: str, x: torch.Tensor, activation: bool = False) -> torch.Tensor:
    """`x` rounded as a `quantization` engine stores a weight, or with `activation` as it rounds a
    matmul's input (dynamic scales per token; fp8's scales are per row either way)."""
    if quantization == "fp8":
        return fp8_roundtrip(x)
    return fp4_roundtrip(x, scale_dims=(-1,) if activation else (-2, -1))


def quantized_targets(model: nn.Module, router: bool = False) -> list[str]:
    """Names of the parameters a quantised engine stores in low precision: the weights of
    attention and MLP linears and the experts' stacked matrices; the router's only with `router`.
    Embeddings, norms and the output head stay in the engine's dtype, as in vLLM's fp8 scheme."""
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
def quantize_(model: nn.Module, names: list[str], quantization: str) -> None:
    """Round the named parameters through `quantization` (fp8 or fp4) in place."""
    params = dict(model.named_parameters())
    for name in names:
        params[name].copy_(roundtrip(quantization, params[name]))


def _grouped_mm_functions() -> tuple:
    """The grouped matmuls an MoE's experts run through (transformers' default `grouped_mm`
    experts: torch's kernel, or transformers' own loop where torch has none); `eager` experts
    call `linear` on slices instead."""
    import transformers.integrations.moe  # noqa: F401 - registers torch.ops.transformers.grouped_mm_fallback

    found = [
        getattr(nn.functional, "grouped_mm", None),
        getattr(torch, "_grouped_mm", None),
        getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None),
    ]
    return tuple(f for f in found if f is not None)


class QuantizedActivations(torch.overrides.TorchFunctionMode):
    """W8A8 / W4A4: while active, every matmul whose weight is one of `weights` gets its input rounded through
    `quantization` with dynamic scales per row, as a quantised engine rounds activations before its low-precision
    matmul. Modes are per thread: enter it on the thread that runs the forward. Other matmuls (the output head, a router
    kept in full precision) are left alone; `matched` holds the weights whose inputs were rounded so far (by storage).

    Details: docs/internals/engines.md"""

    def __init__(self, weights: list[torch.Tensor], quantization: str = "fp8") -> None:
        super().__init__()
        self.quantization = quantization
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
                return self.quantized_matmul(func, args, kwargs)
        return func(*args, **kwargs)

    def quantized_matmul(self, func, args: tuple, kwargs: dict):
        """One matmul on a quantised weight: its input rounded, then the matmul as asked."""
        return func(roundtrip(self.quantization, args[0], activation=True), *args[1:], **kwargs)


def emulate(
    model: torch.nn.Module, quantization: str, quantize_router: bool, quantize_activations: bool, dtype: torch.dtype
) -> tuple[list[str], contextlib.AbstractContextManager, tuple[str, ...]]:
    """An engine's model quantised as `quantization` emulates it (in place): (the tensors rounded,
    the context that quantises their inputs too with `quantize_activations`, the capability notes)."""
    quantized = quantized_targets(model, quantize_router) if quantization != "none" else []
    quantize_(model, quantized, quantization)
    params = dict(model.named_parameters())  # loads copy into these tensors: their storage stays
    activations = (
        QuantizedActivations([params[n] for n in quantized], quantization)
        if quantize_activations
        else contextlib.nullcontext()
    )
    notes = (
        (
            f"{FORMATS.get(quantization, '')}{', and their inputs, per-token scales' if quantize_activations else ''}"
            f", emulated: {len(quantized)} tensors rounded through {quantization}, "
            f"computed in {str(dtype).removeprefix('torch.')}"
            f"{' (router included)' if quantize_router else ' (router not)'}",
        )
        if quantized
        else ()
    )
    return quantized, activations, notes
