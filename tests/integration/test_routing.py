"""Routing capture and replay (R2/R3) on real transformers MoE models (random tiny weights)."""

import pytest
import torch

from shared.kit.tiny import TinySpec, build_model
from shared.models import NotMoEError, RoutingController

VOCAB = 64


def tiny_models():
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    yield "qwen3_moe", build_model(TinySpec(), seed=0)
    yield (
        "qwen2_moe",
        Qwen2MoeForCausalLM(
            Qwen2MoeConfig(
                **common,
                intermediate_size=128,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=64,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=False,
                decoder_sparse_step=1,
            )
        ),
    )
    yield (
        "mixtral",
        MixtralForCausalLM(MixtralConfig(**common, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    )
    yield (
        "olmoe",
        OlmoeForCausalLM(
            OlmoeConfig(**common, intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
        ),
    )


MODELS = dict(tiny_models())


def _randomise_routers(model, scale=0.5):
    # Qwen routers start at zero (every expert ties); give them real, distinct logits.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router, _ in RoutingController(model).routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * scale)


@pytest.fixture(params=sorted(MODELS))
def moe(request):
    model = MODELS[request.param].float().eval()
    _randomise_routers(model)
    return model


def tokens(batch=3, seq=11, seed=0):
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_capture_shape_and_bit_exact_replay(moe):
    controller = RoutingController(moe)
    ids = tokens()
    with torch.no_grad(), controller.capture() as rec:
        captured_logits = moe(ids).logits
    trace = rec.trace(ids.shape)
    assert trace.shape == (3, 11, 2, 2)
    assert int(trace.min()) >= 0 and int(trace.max()) < 8
    with torch.no_grad(), controller.replay(trace):
        replayed_logits = moe(ids).logits
    assert torch.equal(captured_logits, replayed_logits)


def test_replay_after_an_update_uses_recorded_experts_and_trains_the_router(moe):
    controller = RoutingController(moe)
    ids = tokens(seed=1)
    with torch.no_grad(), controller.capture() as rec:
        moe(ids)
    recorded = rec.trace(ids.shape)

    # One optimizer step big enough to move routing.
    optimizer = torch.optim.SGD(moe.parameters(), lr=5.0)
    loss = moe(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    with torch.no_grad(), controller.capture() as rec:
        free_logits = moe(ids).logits
    free = rec.trace(ids.shape)
    changed = (free.sort(-1).values != recorded.sort(-1).values).any(-1)
    assert changed.any(), "the update did not move routing; the test needs a larger step"

    seen = []
    experts = [m for m in moe.modules() if type(m).__name__.endswith("Experts")]
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone())) for m in experts]
    with controller.replay(recorded):
        replay_logits = moe(ids).logits
        replay_loss = torch.nn.functional.cross_entropy(replay_logits.reshape(-1, VOCAB), ids.reshape(-1))
        replay_loss.backward()
    for h in hooks:
        h.remove()
    used = torch.stack(seen, dim=1).reshape(recorded.shape)
    assert torch.equal(used, recorded.to(used.dtype))
    assert not torch.allclose(replay_logits.detach(), free_logits)
    for router, _ in controller.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replay_mask_lets_uncovered_positions_route_freely(moe):
    controller = RoutingController(moe)
    ids = tokens(batch=2, seq=6, seed=2)
    with torch.no_grad(), controller.capture() as rec:
        reference = moe(ids).logits
    trace = rec.trace(ids.shape)
    scrambled = (trace + 1) % 8  # wrong everywhere it is replayed
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[:, -1] = False  # the last position is not covered by the trace
    with torch.no_grad(), controller.replay(scrambled, mask):
        assert not torch.equal(moe(ids).logits, reference)
    with torch.no_grad(), controller.replay(trace, mask):
        partial = moe(ids).logits
    assert torch.equal(partial, reference)


def test_modes_do_not_nest_and_bad_traces_are_refused():
    model = MODELS["qwen3_moe"]
    controller = RoutingController(model)
    with (
        pytest.raises(RuntimeError, match="already in capture mode"),
        controller.capture(),
        controller.replay(torch.zeros(1, 2, 2, 2, dtype=torch.long)),
    ):
        pass
    with pytest.raises(ValueError, match="does not fit"), controller.replay(torch.zeros(1, 2, 3, 2, dtype=torch.long)):
        pass
    with pytest.raises(ValueError, match=r"lie in \[0, 8\)"), controller.replay(torch.full((1, 2, 2, 2), 8)):
        pass
    with (
        pytest.raises(ValueError, match="covers 8 tokens"),
        torch.no_grad(),
        controller.replay(torch.zeros(1, 8, 2, 2, dtype=torch.long)),
    ):
        model(tokens(1, 5))


def test_dense_model_passes_through_and_refuses_traces():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    dense = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
        )
    ).eval()
    controller = RoutingController(dense)
    assert not controller.is_moe
    with torch.no_grad():
        before = dense(tokens()).logits
    with pytest.raises(NotMoEError, match="no MoE router"), controller.capture():
        pass
    with pytest.raises(NotMoEError), controller.replay(torch.zeros(3, 11, 1, 1, dtype=torch.long)):
        pass
    with torch.no_grad():
        assert torch.equal(dense(tokens()).logits, before)
