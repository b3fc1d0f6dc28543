"""The training–inference mismatch each inference precision makes on the tiny MoE, side by side in one run. Prints
one JSON object.

For each setting (fp32, bf16, fp8 and NVFP4 weights, W8A8, W4A4, the router quantised too) the torch engine samples
the same prompts and the fp32 training engine scores the sampled tokens, as the trainer's π_old recompute does:
mismatch KL (k1, k3), |Δ logprob| and routing agreement. fp8 and fp4 are the emulations of
`shared/models/quantization.py`, not their kernels. `--device cuda` runs both on a GPU.

Details: docs/internals/bench.md"""

from __future__ import annotations

import json
import sys
import time

SETTINGS = {  # name → (dtype, quantization, quantize_router, quantize_activations)
    "fp32": ("float32", "none", False, False),
    "bf16": ("bfloat16", "none", False, False),
    "fp32_fp8": ("float32", "fp8", False, False),  # fp8 weights alone, computed in fp32
    "bf16_fp8": ("bfloat16", "fp8", False, False),
    "bf16_fp8_router": ("bfloat16", "fp8", True, False),
    "bf16_fp8_w8a8": ("bfloat16", "fp8", False, True),  # fp8 weights and their inputs: an FP8 engine's matmuls
    "bf16_fp4": ("bfloat16", "fp4", False, False),  # NVFP4 weights (W4A16)
    "bf16_fp4_w4a4": ("bfloat16", "fp4", False, True),  # NVFP4 weights and inputs: an FP4 engine's matmuls
}
PROMPTS = 128
SAMPLES = 4
MAX_NEW_TOKENS = 8


def measure(
    model_dir: str,
    dtype: str,
    quantization: str,
    quantize_router: bool,
    quantize_activations: bool,
    prompts: list[list[int]],
    device: str = "cpu",
) -> dict:
    import torch

    from services.trainer.batch import collate
    from services.trainer.forward import Compute, sequence_logprobs
    from shared.core import routing_agreement
    from shared.core.diagnostics import mismatch_kl_terms
    from shared.engines import Sampling, make_engine
    from shared.models import load_causal_lm
    from shared.models.routing import RoutingController
    from shared.rollouts.record import RolloutTimings
    from shared.rollouts.samples import rollouts_from_samples
    from shared.rpc.steadyrl.v1 import common_pb2

    engine = make_engine(
        "torch",
        model_dir,
        dtype,
        quantization=quantization,
        quantize_router=quantize_router,
        quantize_activations=quantize_activations,
        device=device,
    )
    try:
        samples = engine.generate(
            [p for p in prompts for _ in range(SAMPLES)],
            Sampling(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=7),
            return_trace=True,
        )
    finally:
        engine.close()
    rollouts = [
        r
        for g, prompt in enumerate(prompts)
        for r in rollouts_from_samples(
            common_pb2.PromptTask(task_id=f"t{g}", run_id="mismatch", prompt_token_ids=prompt),
            samples[g * SAMPLES : (g + 1) * SAMPLES],
            [0.0] * SAMPLES,
            "bench",
            "torch",
            RolloutTimings(),
        )
    ]
    where = torch.device(device)
    batch = collate(rollouts).to(where)
    trainer = load_causal_lm(model_dir, "float32", where)
    routing = RoutingController(trainer)
    with torch.no_grad():
        forward = sequence_logprobs(trainer, batch, routing, capture=True, compute=Compute(where))
    routing.close()
    mask = batch.loss_mask
    k1, k3 = mismatch_kl_terms(batch.inference_logprobs.double(), forward.logprobs.double())
    delta = (forward.logprobs.double() - batch.inference_logprobs.double()).abs()[mask]
    agreement = routing_agreement(forward.routing, batch.trace, batch.trace_mask)
    return {
        "tokens": int(mask.sum()),
        "mismatch_kl_k1": float(k1[mask].mean()),
        "mismatch_kl_k3": float(k3[mask].mean()),
        "abs_delta_logprob_mean": float(delta.mean()),
        "abs_delta_logprob_p99": float(delta.quantile(0.99)),
        "abs_delta_logprob_max": float(delta.max()),
        "routing_agreement": float(agreement),
    }


def main(device: str = "cpu") -> dict:
    from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts, init_tiny_model

    started = time.perf_counter()
    model_dir = str(init_tiny_model())
    examples = TinySpec().task(0).split("eval", PROMPTS)
    prompts = encode_prompts(char_tokenizer(), [e.prompt for e in examples])
    result: dict = {
        "benchmark": "mismatch",
        "model": "tiny-qwen3-moe",
        "trainer_dtype": "float32",
        "device": device,
        "prompts": PROMPTS,
        "samples_per_prompt": SAMPLES,
        "max_new_tokens": MAX_NEW_TOKENS,
        "fp8": "emulated: e4m3 weights with per-output-channel scales (w8a8: and their inputs, per-token "
        "scales), computed in bf16",
        "fp4": "emulated: NVFP4 weights, e2m1 in blocks of 16 with e4m3 scales under an fp32 scale per "
        "matrix (w4a4: and their inputs, a scale per token), computed in bf16",
    }
    for name, setting in SETTINGS.items():
        result[name] = {
            k: round(v, 8) if isinstance(v, float) else v
            for k, v in measure(model_dir, *setting, prompts, device).items()
        }
    base = result["bf16"]["mismatch_kl_k3"]
    result["k3_over_bf16"] = {name: round(result[name]["mismatch_kl_k3"] / base, 2) for name in SETTINGS}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
