"""Exact mode's batch-invariant ops (shared/models/batch_invariant.py): a row's bits do not depend on
the rows beside it, on padding before or after it, or on a KV cache; each op computes what torch's
own does (to float32 rounding); the kernel check refuses a machine whose kernels break a property."""

import pytest
import torch
import torch.nn.functional as F

from shared.models import batch_invariant
from shared.models.batch_invariant import BatchInvariant, NotInvariant, attention


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_linear_row_is_the_same_bits_at_any_row_count_and_position():
    generator = torch.Generator().manual_seed(1)
    weight, rows = torch.randn(96, 64, generator=generator), torch.randn(40, 64, generator=generator)
    alone = batch_invariant.linear(rows[:1], weight)[0]
    assert torch.allclose(alone, F.linear(rows[:1], weight)[0], atol=1e-5)
    for count in (1, 2, 3, 4, 9, 40):
        batch = rows[:count].clone()
        batch[count - 1] = rows[0]
        assert torch.equal(batch_invariant.linear(batch, weight)[count - 1], alone), count
    # torch's own: 1, 2-3 and 4+ rows are three different kernels
    own = {F.linear(rows[:count], weight)[0].numpy().tobytes() for count in (1, 2, 4)}
    assert len(own) > 1


def test_attention_is_sdpa_and_a_query_depends_on_its_own_keys_alone():
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 7, 32, generator=generator)
    k, v = (torch.randn(1, 1, 7, 32, generator=generator) for _ in range(2))  # GQA: one key head for two
    full = attention(q, k, v, is_causal=True)
    reference = F.scaled_dot_product_attention(
        q, k[:, :1].expand(1, 2, 7, 32), v[:, :1].expand(1, 2, 7, 32), is_causal=True
    )
    assert torch.allclose(full, reference, atol=1e-5)
    # left padding (a bool mask) and a wider key axis leave every real query's bits as they were
    pads = 3
    padded = [torch.cat([torch.randn(1, t.shape[1], pads, 32, generator=generator), t], dim=2) for t in (q, k, v)]
    mask = torch.ones(10, 10, dtype=torch.bool).tril()
    mask[:, :pads] = False
    left = attention(*padded, attn_mask=mask[None, None])
    assert torch.equal(left[:, :, pads:], full)
    # right padding: keys after the query masked
    wide = [torch.cat([t, torch.randn(1, t.shape[1], 4, 32, generator=generator)], dim=2) for t in (q, k, v)]
    right = attention(*wide, is_causal=True)
    assert torch.equal(right[:, :, :7], full)
    # decode: the last query alone against the cache of its keys
    decode = attention(q[:, :, 6:], k, v)
    assert torch.equal(decode[:, :, 0], full[:, :, 6])
    # a query with no key to attend gives 0, not NaN
    assert torch.equal(left[:, :, 0], torch.zeros_like(left[:, :, 0]))


def test_attentions_gradient_is_sdpas():
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 6, 32, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 1, 6, 32, generator=generator, requires_grad=True) for _ in range(2))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False  # the second row left-padded by two
    upstream = torch.randn(2, 2, 6, 32, generator=generator)
    ours = torch.autograd.grad((attention(q, k, v, attn_mask=mask) * upstream).sum(), (q, k, v))
    theirs_out = F.scaled_dot_product_attention(q, k.expand(2, 2, 6, 32), v.expand(2, 2, 6, 32), attn_mask=mask)
    theirs = torch.autograd.grad((theirs_out.nan_to_num(0.0) * upstream).sum(), (q, k, v))
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.allclose(mine, reference, atol=1e-5)


def test_the_mode_replaces_the_ops_and_they_match_torch():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 33, generator=generator) * 3

    def each_op() -> dict[str, torch.Tensor]:
        return {
            "softmax": torch.softmax(x, dim=-1),
            "log_softmax": F.log_softmax(x, dim=0),
            "silu": F.silu(x),
            "sigmoid": x.sigmoid(),
            "rsqrt": torch.rsqrt(x.abs() + 0.1),
            "mean": x.mean(-1, keepdim=True),
            "sum": x.sum(dim=-1),
            "sum_all": x.sum(),
        }

    with BatchInvariant():
        got = each_op()
    want = each_op()
    for name, value in want.items():
        assert got[name].shape == value.shape and torch.allclose(got[name], value, atol=1e-5), name
    # trailing padding after a row's values changes no bit of its sum (a sequential scan)
    row = torch.rand(1, 50, generator=generator)
    with BatchInvariant():
        alone = row.sum(-1)
        for extra in (1, 14, 200):
            assert torch.equal(torch.cat([row, torch.zeros(1, extra)], dim=1).sum(-1), alone)


def test_the_kernel_check_passes_here_and_refuses_a_row_dependent_linear(monkeypatch, tiny_model_dir):
    from shared.models import load_causal_lm

    model = load_causal_lm(tiny_model_dir, "float32")
    batch_invariant.prepare(model)
    assert model.config._experts_implementation == "eager"
    batch_invariant.check_kernels(model)
    real = batch_invariant.linear
    monkeypatch.setattr(
        batch_invariant, "linear", lambda x, w, b=None: real(x, w, b) * (1 + 1e-7 * (x.shape[0] % 3 == 2))
    )
    with pytest.raises(NotInvariant, match=r"a linear of shape \(\d+, \d+\) gives a row different bits"):
        batch_invariant.check_kernels(model)
