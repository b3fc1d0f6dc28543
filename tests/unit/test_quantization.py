"""Low-precision emulation — FP8 (e4m3 weights with per-output-channel scales) and NVFP4 (e2m1
in blocks of 16 with e4m3 block scales under an fp32 scale per matrix) — by hand and in the
torch engine."""

import pytest
import torch

from shared.models.quantization import (
    FP8_MAX,
    e2m1_round,
    fp4_roundtrip,
    fp8_roundtrip,
    quantize_,
    quantized_targets,
    roundtrip,
)


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
    names = quantized_targets(model)
    assert len(names) == 12 and all(("self_attn" in n and n.endswith("proj.weight")) or ".experts." in n for n in names)
    routers = sorted(set(quantized_targets(model, router=True)) - set(names))
    assert routers == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    before = {n: p.clone() for n, p in model.named_parameters()}
    quantize_(model, names, "fp8")
    after = dict(model.named_parameters())
    for n, p in before.items():
        assert torch.equal(after[n], fp8_roundtrip(p) if n in names else p), n


def test_e2m1_rounds_to_the_nearest_value_ties_to_even_by_hand():
    # midpoints 0.25 0.75 1.25 1.75 2.5 3.5 5 go to the even code: 0, 1, 1, 2, 2, 4, 4; beyond 6 saturates
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.5, -0.3, 0.1, 4.4, 2.9, -1.6, 0.0])
    assert e2m1_round(x).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, 0.0, 4.0, 3.0, -1.5, 0.0]


def test_fp4_roundtrip_by_hand():
    # one row, two blocks of 16. The matrix's amax 6 gives the fp32 scale 6 / (448 × 6) = 1/448.
    # Block 1 (amax 6): its scale 6/6 × 448 = 448 is an e4m3 value, so the elements are e2m1 as they stand.
    first = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.3, 0.1, -6.0, 4.4, 0.0, 1.0, 2.9, -1.6]
    # Block 2 (amax 0.6): 0.6/6 × 448 = 44.8 rounds to 44 in e4m3 (step 4 in [32, 64)), scale 44/448;
    # 0.6 → 6.11 → 6, −0.3 → −3.05 → −3, 0.05 → 0.51 → 0.5 (in units of 44/448)
    w = torch.tensor([first + [0.6, -0.3, 0.05] + [0.0] * 13])
    q = fp4_roundtrip(w)
    s = 44 / 448
    assert q[0, :16].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, 0.0, -6.0, 4.0, 0.0, 1.0, 3.0, -1.5]
    assert torch.allclose(q[0, 16:19], torch.tensor([6 * s, -3 * s, 0.5 * s])) and q[0, 19:].abs().sum() == 0
    # a weight's fp32 scale is one per matrix: beside a row 4096× larger, the small block's e4m3
    # scale (0.1 / (4096 / 448) = 0.0109) falls into e4m3's subnormals and rounds coarser
    both = fp4_roundtrip(torch.cat([w, 4096 * w]))
    assert torch.equal(both[1], 4096 * q[0]) and torch.equal(both[0, :16], q[0, :16])
    assert not torch.equal(both[0, 16:], q[0, 16:])
    stacked = torch.randn(3, 5, 40, dtype=torch.float64)  # experts [E, out, in], 40 inputs: the last block padded
    assert torch.equal(fp4_roundtrip(stacked)[1], fp4_roundtrip(stacked[1]))  # a scale per expert
    assert fp4_roundtrip(stacked).shape == stacked.shape
    assert fp4_roundtrip(torch.zeros(2, 16)).abs().sum() == 0  # an all-zero matrix stays finite
    grid = torch.randn(64, 64)
    error = {fmt: float((roundtrip(fmt, grid) - grid).norm() / grid.norm()) for fmt in ("fp8", "fp4")}
    assert 0.01 < error["fp8"] < 0.04 and 0.06 < error["fp4"] < 0.14  # 3 mantissa bits against 1


@pytest.mark.parametrize("fmt, router", [("fp8", False), ("fp8", True), ("fp4", False)])
def test_the_torch_engine_serves_every_version_through_its_format(tiny_model_dir, fmt, router):
    from shared.engines import Sampling, make_engine
    from shared.models import load_causal_lm

    engine = make_engine("torch", str(tiny_model_dir), "float32", quantization=fmt, quantize_router=router)
    try:
        reference = load_causal_lm(tiny_model_dir, "float32")
        served = dict(engine.model.named_parameters())
        gate = "model.layers.0.mlp.gate.weight"
        ref = dict(reference.named_parameters())
        assert torch.equal(served[gate], roundtrip(fmt, ref[gate]) if router else ref[gate])
        new = {n: p.detach() * 1.5 for n, p in reference.named_parameters()}
        engine.update_weights(1, new)
        engine.generate([[1, 5, 6]], Sampling(max_new_tokens=2))  # the version lands between steps
        served = dict(engine.model.named_parameters())
        assert len(engine.quantized) == 12 + 2 * router
        for name in engine.quantized:
            assert torch.equal(served[name], roundtrip(fmt, new[name])), name
            assert not torch.equal(served[name], new[name]), name
        assert torch.equal(served["lm_head.weight"], new["lm_head.weight"])  # the head stays full precision
        assert engine.version == 1 and {"fp8": "fp8 e4m3", "fp4": "NVFP4"}[fmt] in engine.capabilities.notes[0]
    finally:
        engine.close()
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_engine("torch", str(tiny_model_dir), "float32", quantization="int4")


def test_w8a8_rounds_the_inputs_of_fp8_weights_only_by_hand():
    from torch import nn

    from shared.models.quantization import QuantizedActivations

    torch.manual_seed(0)
    fp8 = nn.Linear(6, 4, bias=True)
    full = nn.Linear(6, 4, bias=False)
    experts = torch.randn(3, 4, 6)  # stacked [E, out, in]; an expert's matmul uses a slice
    x = torch.randn(5, 6) * torch.tensor([[1.0], [10.0], [0.1], [3.0], [0.0]])  # rows of very different scale
    # by hand: each row (token) gets its own scale amax / 448, then e4m3
    rows = []
    for row in x:
        scale = row.abs().max().clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
        rows.append((row / scale).to(torch.float8_e4m3fn).float() * scale)
    xq = torch.stack(rows)
    assert not torch.equal(xq, x) and torch.equal(xq[4], x[4])  # rounded; an all-zero token stays zero
    mode = QuantizedActivations([fp8.weight, experts])
    with mode:
        assert torch.equal(fp8(x), nn.functional.linear(xq, fp8.weight, fp8.bias))
        assert torch.equal(nn.functional.linear(x, experts[1]), nn.functional.linear(xq, experts[1]))
        assert torch.equal(full(x), x @ full.weight.T)  # not an fp8 weight: its input untouched
    assert torch.equal(fp8(x), nn.functional.linear(x, fp8.weight, fp8.bias))  # inactive outside the mode
    with mode:  # re-entered, as the engine does every forward
        assert torch.equal(fp8(x), nn.functional.linear(xq, fp8.weight, fp8.bias))


def test_w4a4_rounds_each_token_through_nvfp4_with_its_own_scale():
    from torch import nn

    from shared.models.quantization import QuantizedActivations

    torch.manual_seed(0)
    layer = nn.Linear(32, 4, bias=False)
    token = torch.randn(32)
    x = torch.stack([token, 2**16 * token, torch.zeros(32)])
    xq = torch.stack([fp4_roundtrip(row[None])[0] for row in x])  # each token alone: its own fp32 scale
    assert not torch.equal(xq[0], x[0]) and xq[2].abs().sum() == 0
    assert torch.equal(xq[1], 2**16 * xq[0])  # a token 2^16× larger rounds to the same codes: the scale is its own
    # one fp32 scale for the whole batch would put token 0's block scales among e4m3's subnormals
    assert not torch.equal(fp4_roundtrip(x)[0], xq[0])
    with QuantizedActivations([layer.weight], "fp4"):
        assert torch.equal(layer(x), nn.functional.linear(xq, layer.weight))


def test_w8a8_reaches_the_experts_whichever_matmul_they_run_on(tiny_model_dir):
    """transformers runs an MoE's experts through a grouped matmul by default, and through a
    `linear` per expert slice when `eager`: W8A8 rounds their inputs either way, to the same
    logits, and every FP8 weight's input is rounded (none left at full precision)."""
    from shared.models import load_causal_lm
    from shared.models.quantization import QuantizedActivations

    ids = torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for experts in ("grouped_mm", "eager"):
        model = load_causal_lm(tiny_model_dir, "float32")
        model.set_experts_implementation(experts)
        assert model.config._experts_implementation == experts
        names = quantized_targets(model)
        quantize_(model, names, "fp8")
        params = dict(model.named_parameters())
        mode = QuantizedActivations([params[n] for n in names])
        with torch.no_grad():
            weights_only = model(input_ids=ids).logits
            with mode:
                logits[experts] = model(input_ids=ids).logits
        assert mode.matched == mode.storages and len(mode.storages) == len(names) == 12
        assert (logits[experts] - weights_only).abs().max() > 1e-3
    assert torch.allclose(logits["grouped_mm"], logits["eager"], atol=1e-5)


def test_the_torch_engine_computes_w8a8_on_its_own_thread(tiny_model_dir):
    """The engine's logprobs with quantize_activations equal the fp8-weight model run under the mode by
    hand, and differ from fp8 weights alone: the mode is active where the engine's forward runs."""
    from shared.engines import Sampling, make_engine
    from shared.models import load_causal_lm
    from shared.models.quantization import QuantizedActivations

    prompt = [1, 5, 6, 7]
    greedy = Sampling(temperature=0, max_new_tokens=4)
    logprobs = {}
    for w8a8 in (False, True):
        engine = make_engine("torch", str(tiny_model_dir), "float32", quantization="fp8", quantize_activations=w8a8)
        try:
            sample = engine.generate([prompt], greedy)[0]
            logprobs[w8a8] = (sample.token_ids, torch.tensor(sample.logprobs))
            assert ("and their inputs" in engine.capabilities.notes[0]) == w8a8
        finally:
            engine.close()
    reference = load_causal_lm(tiny_model_dir, "float32")
    names = quantized_targets(reference)
    quantize_(reference, names, "fp8")
    params = dict(reference.named_parameters())
    tokens, served = logprobs[True]
    ids = torch.tensor([prompt + list(tokens)])
    with torch.no_grad(), QuantizedActivations([params[n] for n in names]):
        logits = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    assert torch.allclose(served, expected, atol=1e-5)
    assert (served - logprobs[False][1]).abs().max() > 1e-4 or tokens != logprobs[False][0]
    with pytest.raises(ValueError, match="quantize_activations needs"):
        make_engine("torch", str(tiny_model_dir), "float32", quantize_activations=True)
