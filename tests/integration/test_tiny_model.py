"""The tiny-model kit: a real HF directory, deterministic, cached, with partial accuracy."""

import json
from dataclasses import replace

import torch

from shared.kit.tiny import TinySpec, greedy_accuracy, init_tiny_model
from shared.kit.tiny_precision import precision_routing_agreement
from shared.models import RoutingController, load_causal_lm, load_tokenizer


def test_tiny_model_loads_and_has_partial_accuracy(tiny_model_dir):
    report = json.loads((tiny_model_dir / "steadyrl_tiny.json").read_text())
    model = load_causal_lm(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.head_dim in (32, 64)
    assert RoutingController(model).num_experts == 8
    assert tokenizer.decode(tokenizer.encode("12+34=", add_special_tokens=False)) == "12+34="
    spec = TinySpec(**report["spec"])
    task = spec.task(0)
    accuracy = greedy_accuracy(model, tokenizer, task.split("eval", spec.sft_eval_size))
    assert accuracy == report["greedy_accuracy"]
    assert 0.1 <= accuracy <= 0.6


def test_bf16_routing_differs_from_fp32(tiny_model_dir):
    result = precision_routing_agreement(tiny_model_dir, size=64)
    assert 0.5 < result["routing_agreement"] < 1.0
    assert result["answer_logprob_abs_diff_mean"] > 0


def test_init_is_deterministic_and_cached(tmp_path):
    spec = replace(TinySpec(), sft_max_steps=20, sft_eval_every=10, sft_eval_size=16, target_accuracy=1.0)
    first = init_tiny_model(tmp_path / "a", spec=spec, seed=3, cache_dir=tmp_path / "cache1")
    second = init_tiny_model(tmp_path / "b", spec=spec, seed=3, cache_dir=tmp_path / "cache2")
    one = load_causal_lm(first).state_dict()
    two = load_causal_lm(second).state_dict()
    assert all(torch.equal(one[k], two[k]) for k in one)
    cached = next((tmp_path / "cache1").iterdir())
    stamp = (cached / "steadyrl_tiny.json").stat().st_mtime_ns
    init_tiny_model(tmp_path / "c", spec=spec, seed=3, cache_dir=tmp_path / "cache1")
    assert (cached / "steadyrl_tiny.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    other = init_tiny_model(None, spec=spec, seed=4, cache_dir=tmp_path / "cache1")
    assert other != cached
    # a second delivery to the same place leaves the model there untouched (a rerun of compose's model-init
    # while services read it); another seed's model replaces it
    weights = first / "model.safetensors"
    written = weights.stat().st_mtime_ns
    init_tiny_model(first, spec=spec, seed=3, cache_dir=tmp_path / "cache1")
    assert weights.stat().st_mtime_ns == written
    init_tiny_model(first, spec=spec, seed=4, cache_dir=tmp_path / "cache1")
    assert weights.stat().st_mtime_ns != written
    assert (first / "steadyrl_tiny.json").read_bytes() == (other / "steadyrl_tiny.json").read_bytes()
