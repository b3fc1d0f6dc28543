"""Batch-invariant forwards (exact mode): a token's numbers depend only on its own sequence.

Inside `BatchInvariant` (a torch function mode, entered on the thread that computes: the engine's
thread and the trainer's forwards), the ops whose CPU kernels give a row other bits by batch size,
padding, row position or KV cache are replaced by forms with one reduction order per element:
linears of at least 4 rows, sums as a fixed tree, silu/sigmoid/rsqrt from exp and IEEE arithmetic,
attention as padded matmuls. `check_kernels` measures at start that this machine's kernels hold
what the forms rely on, and refuses exact mode if not.

Details (each op, and why): docs/guides/exact.md"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

MIN_ROWS = 4  # the fewest rows of a matmul: below it MKL's sgemm takes row-count-specific kernels
MIN_KEYS = 16  # the fewest keys of attention's score matmul: below 12 columns MKL takes another kernel


class NotInvariant(RuntimeError):
    """This machine's kernels do not hold a property exact mode relies on."""


def _last_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Σ over the last dimension as a fixed tree over its values padded with −0.0 to a power of two
    (each level adds the second half to the first): a wider padding only adds −0.0 to every value
    first, so padding after a row's values changes no bit of its sum, nor do the rows beside it."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.cat([x, x.new_full((*x.shape[:-1], width - n), -0.0)], dim=-1)
    while x.shape[-1] > 1:  # value i plus value i + half (unbind: a cheap backward)
        low, high = x.unflatten(-1, (2, x.shape[-1] // 2)).unbind(-2)
        x = low + high
    return x if keepdim else x.squeeze(-1)


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
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[-2]
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
    if is_causal:
        allowed = torch.tril(allowed)
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            bias = attn_mask.expand(batch, heads, q_len, kv_len)
            allowed = allowed & (attn_mask > float("-inf"))
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    allowed = allowed.expand(batch, heads, q_len, kv_len)
    short = MIN_KEYS - kv_len  # zero keys after the last, masked: the score matmul's kernel below 12 differs
    if short > 0:
        key, value = (torch.cat([t, t.new_zeros(*t.shape[:-2], short, t.shape[-1])], dim=-2) for t in (key, value))
        allowed = torch.cat([allowed, allowed.new_zeros(batch, heads, q_len, short)], dim=-1)
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(batch, heads, q_len, short)], dim=-1)
    # a group's query heads as rows of one matmul against their shared key head (no repeated keys)
    rows = heads // kv_heads * q_len
    grouped = query.reshape(batch, kv_heads, rows, head_dim)
    scores = (_at_least_rows(grouped) @ key.transpose(-1, -2))[..., :rows, :] * scale
    scores = scores.reshape(batch, heads, q_len, -1)
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, float("-inf"))  # e = exp(−inf) = +0 there
    peak = scores.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))  # a query with no key: output 0
    e = torch.exp(scores - peak).reshape(batch, kv_heads, rows, -1)
    # Σ_j e_j v_j and Σ_j e_j in one matmul (values with a column of ones): each in key-position order
    summed = _at_least_rows(e) @ torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)
    summed = summed[..., :rows, :].reshape(batch, heads, q_len, head_dim + 1)
    numerator, denominator = summed[..., :-1], summed[..., -1:]
    return numerator / torch.where(denominator > 0, denominator, torch.ones_like(denominator))


def _at_least_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` ([..., rows, columns]) with zero rows added up to MIN_ROWS (a matmul's kernel below it differs)."""
    short = MIN_ROWS - x.shape[-2]
    return x if short <= 0 else torch.cat([x, x.new_zeros(*x.shape[:-2], short, x.shape[-1])], dim=-2)


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
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    _check_attention_matmuls(int(head_dim), generator, device)
    values = torch.randn(512, generator=generator).to(device) * 4
    for name, op in (("exp", torch.exp), ("log", lambda t: torch.log(t.abs() + 0.5)), ("sin", torch.sin)):
        whole = op(values)
        for start, length in ((0, 1), (3, 17), (5, 64), (33, 100), (200, 311)):
            if not torch.equal(op(values[start : start + length].clone()), whole[start : start + length]):
                raise NotInvariant(f"elementwise {name} rounds an element by where it sits on this machine")


def _check_attention_matmuls(head_dim: int, generator: torch.Generator, device) -> None:
    """Attention's two matmuls: a query row's scores against the same keys, and a weights row against
    the same values (with the ones column) wherever they sit among masked zeros, the same bits at any
    batch, row count from MIN_ROWS and key count from MIN_KEYS."""
    query = torch.randn(head_dim, generator=generator).to(device)
    keys = torch.randn(MIN_KEYS, head_dim, generator=generator).to(device)
    weights = torch.rand(10, generator=generator).to(device)
    values = torch.randn(10, head_dim + 1, generator=generator).to(device)
    seen: dict[str, set] = {"scores": set(), "weighted values": set()}
    for batch, rows, width, offset in ((1, 4, 16, 0), (3, 5, 23, 6), (2, 14, 64, 54), (5, 33, 100, 3)):
        q = torch.randn(batch, rows, head_dim, generator=generator).to(device)
        q[-1, -1] = query
        k = torch.randn(batch, width, head_dim, generator=generator).to(device)
        k[-1, :MIN_KEYS] = keys
        seen["scores"].add((q @ k.transpose(-1, -2))[-1, -1, :MIN_KEYS].cpu().numpy().tobytes())
        p = torch.rand(batch, rows, width, generator=generator).to(device)
        p[-1, -1] = 0.0
        p[-1, -1, offset : offset + 10] = weights
        v = torch.randn(batch, width, head_dim + 1, generator=generator).to(device)
        v[-1, offset : offset + 10] = values
        seen["weighted values"].add((p @ v)[-1, -1].cpu().numpy().tobytes())
    for name, results in seen.items():
        if len(results) > 1:
            raise NotInvariant(f"attention's {name} matmul gives a row different bits by batch shape on this machine")
