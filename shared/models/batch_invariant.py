"""Batch-invariant forwards (exact mode): a token's numbers depend only on its own sequence.

Inside `BatchInvariant` (a torch function mode, entered on the thread that computes), the ops of a
transformers causal LM whose CPU kernels give a row different bits by batch size, padding or row
position are replaced by formulations with one reduction order per element:

- `linear`: at least 4 rows (MKL's sgemm is row-invariant from 4 rows on, one thread; below it
  switches kernels), padded with zero rows;
- softmax, log-softmax and sums/means over the last dimension: a pairwise tree over the values padded
  to a power of two with −0.0 (IEEE's additive identity), so a row's sum is the same tree whatever
  padding follows it and whatever rows share its batch;
- silu, sigmoid and rsqrt from `exp`, `sqrt` and IEEE arithmetic (their own kernels round a
  vector's tail elements differently from its body);
- `scaled_dot_product_attention`: scores as elementwise products summed by that tree over the head
  dimension; the keys of each row moved to start at index 0 (left padding removed), and the softmax's
  denominator and the weighted sum of values summed by the tree over the key axis, so left padding,
  right padding, a KV cache (decode) and a full forward give the same bits.

The engine's sampling forwards and the trainer's forwards both run under it, so the sampling
logprob and the recomputed one are one function of one sequence. `check_kernels` measures at
start that this machine's kernels have the properties relied on, and refuses exact mode if not.

Details: docs/guides/exact.md"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MIN_ROWS = 4  # the fewest rows of a linear: below it MKL's sgemm takes row-count-specific kernels


class NotInvariant(RuntimeError):
    """This machine's kernels do not hold a property exact mode relies on."""


def _tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Σ over `dim` as a fixed tree over its values padded with −0.0 to a power of two (each level adds
    the second half to the first): a wider padding only adds −0.0 to every value first, so padding
    after a row's values changes no bit of its sum."""
    dim = dim % x.dim()
    n = x.shape[dim]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        shape = list(x.shape)
        shape[dim] = width - n
        x = torch.cat([x, x.new_full(shape, -0.0)], dim=dim)
    while x.shape[dim] > 1:  # value i plus value i + half (unbind: a cheap backward)
        low, high = x.unflatten(dim, (2, x.shape[dim] // 2)).unbind(dim)
        x = low + high
    return x if keepdim else x.squeeze(dim)


def _last_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    return _tree_sum(x, -1, keepdim)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    short = MIN_ROWS - rows.shape[0]
    if short > 0:
        rows = torch.cat([rows, rows.new_zeros(short, rows.shape[1])])
    out = F.linear(rows, weight, bias)
    if short > 0:
        out = out[: out.shape[0] - short]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / torch.sqrt(x)


def _rows_last(x: torch.Tensor, dim, dtype: torch.dtype | None) -> tuple[torch.Tensor, bool]:
    x = x.to(dtype) if dtype is not None else x
    last = dim in (-1, x.dim() - 1)
    return (x if last else x.movedim(dim, -1)), last


def softmax(x: torch.Tensor, dim=None, _stacklevel: int = 3, dtype: torch.dtype | None = None):
    if dim is None:
        return NotImplemented
    rows, last = _rows_last(x, dim, dtype)
    e = torch.exp(rows - rows.amax(-1, keepdim=True))
    out = e / _last_sum(e, keepdim=True)
    return out if last else out.movedim(-1, dim)


def log_softmax(x: torch.Tensor, dim=None, _stacklevel: int = 3, dtype: torch.dtype | None = None):
    if dim is None:
        return NotImplemented
    rows, last = _rows_last(x, dim, dtype)
    shifted = rows - rows.amax(-1, keepdim=True)
    out = shifted - torch.log(_last_sum(torch.exp(shifted), keepdim=True))
    return out if last else out.movedim(-1, dim)


def _last_dim(x: torch.Tensor, dim) -> bool:
    if isinstance(dim, (tuple, list)):
        dim = dim[0] if len(dim) == 1 else None
    return dim is not None and dim in (-1, x.dim() - 1)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`scaled_dot_product_attention` ([B, H, Sq, D] queries, [B, Hkv, Skv, D] keys and values; a
    bool mask, True = attend, or an additive one; causal aligned top-left) with every sum taken in
    key-position order: a query's output depends on its valid keys alone, wherever they sit."""
    if dropout_p:
        raise ValueError("exact attention has no dropout")
    if key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
    if is_causal:
        allowed = torch.tril(allowed)
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            bias = attn_mask
            allowed = allowed & (attn_mask > float("-inf"))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _ExactAttention.apply(query, key, value, allowed, bias, scale)
    with torch.no_grad():
        return _attention(query, key, value, allowed, bias, scale)


def _attention(query, key, value, allowed, bias, scale: float) -> torch.Tensor:
    """Exact attention's values (see `attention`)."""
    kv_len = key.shape[-2]
    products = query.unsqueeze(-1) * key.transpose(-1, -2).unsqueeze(-3)  # [B, H, Sq, D, Skv]
    scores = _tree_sum(products, dim=-2) * scale  # [B, H, Sq, Skv]
    if bias is not None:
        scores = scores + bias
    allowed = allowed.expand_as(scores)
    scores = scores.masked_fill(~allowed, float("-inf"))  # e = exp(−inf) = +0 there
    peak = scores.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # a query with no key: output 0
    e = torch.exp(scores - peak)
    # each row's keys from index 0 in position order, padded to a power of two: shift by its leading
    # masked keys (left padding); every entry past its keys weighs 0
    pad = allowed.any(dim=-2, keepdim=True).int().argmax(dim=-1, keepdim=True)  # [B, H, 1, 1]
    width = 1 << max(kv_len - 1, 0).bit_length()
    index = torch.arange(width, device=query.device) + pad  # [B, H, 1, width]
    inside = index < kv_len
    index = index.clamp(max=kv_len - 1)
    e = torch.where(inside, e.gather(-1, index.expand(*e.shape[:-1], width)), 0.0)
    value = value.gather(-2, index.transpose(-1, -2).expand(*value.shape[:-2], width, value.shape[-1]))
    denominator = _last_sum(e, keepdim=True)
    weights = e / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    return _tree_sum(weights.unsqueeze(-1) * value.unsqueeze(-3), dim=-2)  # Σ over keys of [B, H, Sq, Skv, D]


def _reference_attention(query, key, value, allowed, bias, scale: float) -> torch.Tensor:
    """The same attention with torch's own kernels: what the backward differentiates."""
    scores = (query @ key.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no key: 0
    return weights @ value


class _ExactAttention(torch.autograd.Function):
    """Exact attention's values with the gradient of the same function computed by torch's own
    kernels (a gradient is not part of what exact mode makes equal; its 5-D backward cost 3× the
    forward)."""

    @staticmethod
    def forward(ctx, query, key, value, allowed, bias, scale):
        ctx.save_for_backward(query, key, value, allowed, bias)
        ctx.scale = scale
        return _attention(query, key, value, allowed, bias, scale)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, allowed, bias = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (query, key, value)]
        with torch.enable_grad():
            out = _reference_attention(*inputs, allowed, bias, ctx.scale)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None)


def _sum(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None):
    if not _last_dim(x, dim) or x.is_complex() or not x.is_floating_point():
        return NotImplemented
    return _last_sum(x.to(dtype) if dtype is not None else x, keepdim)


def _mean(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None):
    if not _last_dim(x, dim) or not x.is_floating_point():
        return NotImplemented
    x = x.to(dtype) if dtype is not None else x
    return _last_sum(x, keepdim) / x.shape[-1]


_REPLACED = {
    F.linear: linear,
    F.silu: silu,
    F.sigmoid: sigmoid,
    torch.sigmoid: sigmoid,
    torch.Tensor.sigmoid: sigmoid,
    torch.rsqrt: rsqrt,
    torch.Tensor.rsqrt: rsqrt,
    F.softmax: softmax,
    torch.softmax: softmax,
    torch.Tensor.softmax: softmax,
    F.log_softmax: log_softmax,
    torch.log_softmax: log_softmax,
    torch.Tensor.log_softmax: log_softmax,
    F.scaled_dot_product_attention: attention,
    torch.sum: _sum,
    torch.Tensor.sum: _sum,
    torch.mean: _mean,
    torch.Tensor.mean: _mean,
}


class BatchInvariant(TorchFunctionMode):
    """The ops above replaced by their batch-invariant forms inside the block (this thread only)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        replacement = _REPLACED.get(func)
        if replacement is not None:
            out = replacement(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def prepare(model: torch.nn.Module) -> None:
    """A model for exact forwards: the MoE experts as a loop of linears (each one batch-invariant
    here) instead of a grouped matmul whose CPU kernel this mode does not cover."""
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")


def check_kernels(model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
    """NotInvariant unless, on this thread's kernels, every linear shape of `model` gives a row the
    same bits at any row count from MIN_ROWS and any row position, elementwise exp/log/sin/cos give
    an element the same bits wherever it sits, and an exact forward of one sequence equals the same
    sequence in a padded batch. Run where the forwards run (thread count included)."""
    generator = torch.Generator().manual_seed(0)
    shapes = sorted({tuple(p.shape[-2:]) for p in model.parameters() if p.dim() >= 2})
    for n, k in shapes:
        weight = torch.randn(n, k, generator=generator).to(device)
        rows = torch.randn(70, k, generator=generator).to(device)
        expected = linear(rows[:1], weight)[0]
        for count in (MIN_ROWS, 5, 7, 8, 13, 16, 33, 70):
            batch = rows[:count].clone()
            at = count // 2
            batch[at] = rows[0]
            got = linear(batch, weight)[at]
            if not torch.equal(got, expected):
                raise NotInvariant(
                    f"a linear of shape ({n}, {k}) gives a row different bits at {count} rows on this machine's "
                    "kernels: exact mode needs torch_threads = 1 and MKL's row-invariant sgemm"
                )
    values = torch.randn(512, generator=generator).to(device) * 4
    for name, op in (("exp", torch.exp), ("log", lambda t: torch.log(t.abs() + 0.5)), ("sin", torch.sin)):
        whole = op(values)
        for start, length in ((0, 1), (3, 17), (5, 64), (33, 100), (200, 311)):
            if not torch.equal(op(values[start : start + length].clone()), whole[start : start + length]):
                raise NotInvariant(f"elementwise {name} rounds an element by where it sits on this machine")
