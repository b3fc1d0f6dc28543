"""FP8 emulation: e4m3 weights with per-output-channel scales, by hand and in the torch engine."""

import pytest
import torch

from shared.models.quantization import FP8_MAX, fp8_roundtrip, fp8_targets, quantize_fp8_


def test_fp8_roundtrip_by_hand():
    # scale = amax / 448 per row; 1.0 → 448 and −0.5 → −224 are e4m3 values; 0.3 → 134.4 lies
    # between 128 and 144 (step 16 in [128, 256)) and rounds to 128 → 128 / 448
    w = torch.tensor([[1.0, -0.5, 0.3], [0.0, 0.0, 2.0]])
    q = fp8_roundtrip(w)
    assert torch.equal(q[0], torch.tensor([1.0, -0.5, 128 / 448]))
    assert torch.equal(q[1], torch.tensor([0.0, 0.0, 2.0]))  # each row its own scale
    assert torch.equal(fp8_roundtrip(q), q)  # idempotent: what an engine re-quantises does not drift
    assert FP8_MAX == 448.0
    stacked = torch.randn(3, 5, 7, dtype=torch.float64)  # experts [E, out, in]: a scale per (expert, out)
    assert torch.equal(fp8_roundtrip(stacked)[1], fp8_roundtrip(stacked[1]))
    assert fp8_roundtrip(torch.zeros(2, 2)).abs().sum() == 0  # an all-zero row stays finite


def test_fp8_targets_leave_embeddings_norms_head_and_router(tiny_model_dir):
    from shared.models import load_causal_lm

    model = load_causal_lm(tiny_model_dir, "float32")
    names = fp8_targets(model)
    assert len(names) == 12 and all(("self_attn" in n and n.endswith("proj.weight")) or ".experts." in n for n in names)
    routers = sorted(set(fp8_targets(model, router=True)) - set(names))
    assert routers == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    before = {n: p.clone() for n, p in model.named_parameters()}
    quantize_fp8_(model, names)
    after = dict(model.named_parameters())
    for n, p in before.items():
        assert torch.equal(after[n], fp8_roundtrip(p) if n in names else p), n


@pytest.mark.parametrize("router", [False, True])
def test_the_torch_engine_serves_every_version_through_fp8(tiny_model_dir, router):
    from shared.engines import Sampling, make_engine
    from shared.models import load_causal_lm

    engine = make_engine("torch", str(tiny_model_dir), "float32", quantization="fp8", fp8_router=router)
    try:
        reference = load_causal_lm(tiny_model_dir, "float32")
        served = dict(engine.model.named_parameters())
        gate = "model.layers.0.mlp.gate.weight"
        ref = dict(reference.named_parameters())
        assert torch.equal(served[gate], fp8_roundtrip(ref[gate]) if router else ref[gate])
        new = {n: p.detach() * 1.5 for n, p in reference.named_parameters()}
        engine.update_weights(1, new)
        engine.generate([[1, 5, 6]], Sampling(max_new_tokens=2))  # the version lands between steps
        served = dict(engine.model.named_parameters())
        for name in engine.fp8:
            assert torch.equal(served[name], fp8_roundtrip(new[name])), name
        assert torch.equal(served["lm_head.weight"], new["lm_head.weight"])  # the head stays full precision
        assert engine.version == 1 and "fp8 e4m3" in engine.capabilities.notes[0]
    finally:
        engine.close()
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_engine("torch", str(tiny_model_dir), "float32", quantization="int4")
