"""Trainer on one GPU: global steps of the wide random-init Qwen3-MoE of `bench.trainer_memory`
(hidden 1024, 64 experts, top-8, 4 layers, 214.7 M parameters) on one batch of 64 rollouts of
512 tokens, side by side in one process: fp32, bf16-mixed, and bf16-mixed with activation
checkpointing and micro-batches of 8,192 tokens — step seconds, trained tokens/s and peak CUDA
memory of each, and their ratios to fp32. Needs CUDA: without it, prints why and exits 2.

`python -m bench.trainer_gpu` (or `steadyrl bench trainer --gpu`)."""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

ROUNDS = 5
SETTINGS = {  # name → (precision, activation_checkpointing, micro_batch_tokens)
    "fp32": ("fp32", False, 0),
    "bf16_mixed": ("bf16-mixed", False, 0),
    "bf16_mixed_checkpointed": ("bf16-mixed", True, 8192),
}


def batch(groups: int = 16, group: int = 4, prompt: int = 64, completion: int = 448):
    """The step's rollouts, collated on the host (the step moves each micro-batch to the device)."""
    import numpy as np

    from services.trainer.batch import collate
    from shared.rollouts.record import Rollout

    rng = np.random.default_rng(0)
    rows = [
        Rollout(
            rollout_id=f"t{g}:{i}",
            group_id=f"t{g}",
            task_id=f"t{g}",
            sample_index=i,
            group_size=group,
            prompt_token_ids=rng.integers(3, 250, prompt).astype(np.int32),
            completion_token_ids=rng.integers(3, 250, completion).astype(np.int32),
            inference_logprobs=-rng.random(completion, dtype=np.float32) * 6,
            policy_versions=np.zeros(completion, np.uint64),
            reward=float(rng.random() < 0.5),
        )
        for g in range(groups)
        for i in range(group)
    ]
    return collate(rows), group


def measure(name: str, device: torch.device) -> dict:
    from bench.trainer_memory import wide_model
    from services.trainer.config import TrainerSettings
    from services.trainer.forward import Compute
    from services.trainer.global_step import StepConfig, train_step
    from services.trainer.parallel import prepare
    from shared.models.routing import RoutingController

    precision, checkpointing, micro = SETTINGS[name]
    model = wide_model()
    model.config.max_position_embeddings = 1024
    routing = RoutingController(model)
    settings = TrainerSettings(
        model_path="-",
        compute={"precision": precision, "activation_checkpointing": checkpointing, "micro_batch_tokens": micro},
    )
    model = prepare(model, settings, device, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    compute = Compute(device, torch.bfloat16 if precision == "bf16-mixed" else None, micro)
    train, group = batch()
    torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    tokens = 0.0
    for step in range(ROUNDS + 1):  # the first is a warm-up
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        metrics = train_step(model, optimizer, routing, train, group, StepConfig(), step, compute=compute)
        torch.cuda.synchronize(device)
        if step:
            seconds.append(time.perf_counter() - started)
        tokens = metrics["tokens"]
    median = statistics.median(seconds)
    result = {
        "step_seconds": round(median, 4),
        "tokens_per_s": round(tokens / median, 1),
        "peak_cuda_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    del model, optimizer
    torch.cuda.empty_cache()
    return result


def main() -> dict:
    if not torch.cuda.is_available():
        sys.stderr.write("bench.trainer_gpu needs CUDA: this machine has no GPU\n")
        sys.exit(2)
    device = torch.device("cuda", 0)
    out: dict = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "rounds": ROUNDS,
        "batch": {"rollouts": 64, "tokens_per_rollout": 512},
    }
    for name in SETTINGS:
        out[name] = measure(name, device)
    base = out["fp32"]
    out["ratios_to_fp32"] = {
        name: {
            "step_seconds": round(out[name]["step_seconds"] / base["step_seconds"], 3),
            "peak_cuda_memory": round(out[name]["peak_cuda_gib"] / base["peak_cuda_gib"], 3),
        }
        for name in SETTINGS
        if name != "fp32"
    }
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main()) + "\n")
