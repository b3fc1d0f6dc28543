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


def test_w8a8_rounds_the_inputs_of_fp8_weights_only_by_hand():
    from torch import nn

    from shared.models.quantization import FP8Activations

    torch.manual_seed(0)
    fp8, full = nn.Linear(6, 4, bias=True), nn.Linear(6, 4, bias=False)
    experts = torch.randn(3, 4, 6)  # stacked [E, out, in]; an expert's matmul uses a slice
    x = torch.randn(5, 6) * torch.tensor([[1.0], [10.0], [0.1], [3.0], [0.0]])  # rows of very different scale
    # by hand: each row (token) gets its own scale amax / 448, then e4m3
    rows = []
    for row in x:
        scale = row.abs().max().clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
        rows.append((row / scale).to(torch.float8_e4m3fn).float() * scale)
    xq = torch.stack(rows)
    assert not torch.equal(xq, x) and torch.equal(xq[4], x[4])  # rounded; an all-zero token stays zero
    mode = FP8Activations([fp8.weight, experts])
    with mode:
        assert torch.equal(fp8(x), nn.functional.linear(xq, fp8.weight, fp8.bias))
        assert torch.equal(nn.functional.linear(x, experts[1]), nn.functional.linear(xq, experts[1]))
        assert torch.equal(full(x), x @ full.weight.T)  # not an fp8 weight: its input untouched
    assert torch.equal(fp8(x), nn.functional.linear(x, fp8.weight, fp8.bias))  # inactive outside the mode
    with mode:  # re-entered, as the engine does every forward
        assert torch.equal(fp8(x), nn.functional.linear(xq, fp8.weight, fp8.bias))


def test_w8a8_reaches_the_experts_whichever_matmul_they_run_on(tiny_model_dir):
    """transformers runs an MoE's experts through a grouped matmul by default, and through a
    `linear` per expert slice when `eager`: W8A8 rounds their inputs either way, to the same
    logits, and every FP8 weight's input is rounded (none left at full precision)."""
    from shared.models import load_causal_lm
    from shared.models.quantization import FP8Activations

    ids = torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for experts in ("grouped_mm", "eager"):
        model = load_causal_lm(tiny_model_dir, "float32")
        model.set_experts_implementation(experts)
        assert model.config._experts_implementation == experts
        names = fp8_targets(model)
        quantize_fp8_(model, names)
        params = dict(model.named_parameters())
        mode = FP8Activations([params[n] for n in names])
        with torch.no_grad():
            weights_only = model(input_ids=ids).logits
            with mode:
                logits[experts] = model(input_ids=ids).logits
        assert mode.matched == mode.storages and len(mode.storages) == len(names) == 12
        assert (logits[experts] - weights_only).abs().max() > 1e-3
    assert torch.allclose(logits["grouped_mm"], logits["eager"], atol=1e-5)


def test_the_torch_engine_computes_w8a8_on_its_own_thread(tiny_model_dir):
    """The engine's logprobs with fp8_activations equal the fp8-weight model run under the mode by
    hand, and differ from fp8 weights alone: the mode is active where the engine's forward runs."""
    from shared.engines import Sampling, make_engine
    from shared.models import load_causal_lm
    from shared.models.quantization import FP8Activations

    prompt, greedy = [1, 5, 6, 7], Sampling(temperature=0, max_new_tokens=4)
    logprobs = {}
    for w8a8 in (False, True):
        engine = make_engine("torch", str(tiny_model_dir), "float32", quantization="fp8", fp8_activations=w8a8)
        try:
            sample = engine.generate([prompt], greedy)[0]
            logprobs[w8a8] = (sample.token_ids, torch.tensor(sample.logprobs))
            assert ("and their inputs" in engine.capabilities.notes[0]) == w8a8
        finally:
            engine.close()
    reference = load_causal_lm(tiny_model_dir, "float32")
    names = fp8_targets(reference)
    quantize_fp8_(reference, names)
    params = dict(reference.named_parameters())
    tokens, served = logprobs[True]
    ids = torch.tensor([prompt + list(tokens)])
    with torch.no_grad(), FP8Activations([params[n] for n in names]):
        logits = reference(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    assert torch.allclose(served, expected, atol=1e-5)
    assert (served - logprobs[False][1]).abs().max() > 1e-4 or tokens != logprobs[False][0]
    with pytest.raises(ValueError, match="fp8_activations needs"):
        make_engine("torch", str(tiny_model_dir), "float32", fp8_activations=True)
