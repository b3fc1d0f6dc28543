"""Property tests of the MiniRL loss (hypothesis)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from shared.core import LossConfig, policy_loss

CONFIGS = st.builds(
    LossConfig,
    objective=st.sampled_from(["minirl", "grpo"]),
    train_infer_is=st.booleans(),
    clip=st.booleans(),
    is_level=st.sampled_from(["token", "sequence"]),
    normalization=st.sampled_from(["tokens", "sequence"]),
    rejection=st.sampled_from(["none", "seq_mis", "geo", "icepop"]),
)


@st.composite
def batches(draw, max_b=5, max_t=7):
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    lp = lambda: -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3  # noqa: E731
    mask = torch.rand(b, t, generator=gen) < draw(st.floats(0.2, 1.0))
    advantages = torch.randn(b, generator=gen, dtype=torch.float64)
    return lp(), lp(), lp(), advantages, mask


def grad_of(trainer, old, inference, advantages, mask, config, **kwargs):
    trainer = trainer.clone().requires_grad_(True)
    loss, metrics = policy_loss(trainer, old, inference, advantages, mask, config, **kwargs)
    loss.backward()
    return loss, metrics, trainer.grad


@settings(max_examples=200, deadline=None)
@given(batches())
def test_on_policy_minirl_gradient_is_reinforce(batch):
    """π_θ = π_old = μ_old: ∇ MiniRL = ∇ of −Σ M·Â·log π / N (REINFORCE)."""
    lp, _, _, advantages, mask = batch
    _, metrics, grad = grad_of(lp, lp, lp, advantages, mask, LossConfig())
    tokens = mask.sum().clamp(min=1)
    reinforce = lp.clone().requires_grad_(True)
    (-(mask * advantages[:, None] * reinforce).sum() / tokens).backward()
    assert_close(grad, reinforce.grad)
    if mask.any():
        assert metrics["is_weight_mean"].item() == 1.0
        assert metrics["clip_frac"].item() == 0.0


@settings(max_examples=200, deadline=None)
@given(batches(), CONFIGS)
def test_masked_tokens_get_zero_gradient(batch, config):
    trainer, old, inference, advantages, mask = batch
    _, _, grad = grad_of(trainer, old, inference, advantages, mask, config)
    assert torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**31 - 1), st.data(), st.booleans(), st.booleans())
def test_tokens_normaliser_ignores_how_tokens_split_into_sequences(n, seed, data, clip, tis):
    """With per-token advantages, the "tokens" loss only depends on the multiset of tokens."""
    gen = torch.Generator().manual_seed(seed)
    flat = [-torch.rand(n, generator=gen, dtype=torch.float64) * 3 for _ in range(3)]
    flat_adv = torch.randn(n, generator=gen, dtype=torch.float64)
    config = LossConfig(clip=clip, train_infer_is=tis)

    def layout(cuts):
        bounds = [0, *sorted(set(cuts)), n]
        spans = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
        width = max(b - a for a, b in spans) + data.draw(st.integers(0, 2))
        out = [torch.zeros(len(spans), width, dtype=torch.float64) for _ in range(4)]
        mask = torch.zeros(len(spans), width, dtype=torch.bool)
        for row, (a, b) in enumerate(spans):
            for tensor, source in zip(out, [*flat, flat_adv], strict=True):
                tensor[row, : b - a] = source[a:b]
            mask[row, : b - a] = True
        trainer, old, inference, adv = out
        return policy_loss(trainer, old, inference, adv, mask, config)[0]

    one = layout(data.draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=6)))
    two = layout(data.draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=6)))
    assert_close(one, two)


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from(["minirl", "grpo"]), st.sampled_from(["token", "sequence"]))
def test_without_train_infer_is_the_weight_is_exactly_one(batch, objective, level):
    trainer, old, inference, advantages, mask = batch
    config = LossConfig(objective=objective, train_infer_is=False, is_level=level, clip=False)
    _, metrics, grad = grad_of(trainer, old, inference, advantages, mask, config)
    if mask.any():
        assert metrics["is_weight_mean"].item() == 1.0
        assert metrics["is_weight_max"].item() == 1.0
    if objective == "minirl":
        # ∇ = −mask·Â / N exactly: no weight anywhere.
        expected = -(mask * advantages[:, None]) / mask.sum().clamp(min=1)
        assert_close(grad, expected.to(grad.dtype))
