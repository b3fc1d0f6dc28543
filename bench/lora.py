"""LoRA against full fine-tuning, side by side in one run. Prints one JSON object.

Three comparisons: the bytes per version, adapter-only (`trainer.lora.publish = "adapter"`) against full, on a
30B-A3B-shaped and a ~210 M-parameter Qwen3-MoE at rank 32; the trainer step (seconds, peak memory, parameter +
gradient + AdamW bytes); and the refit end to end (bench/weightsync.py's groups) per transport, full bf16 versions
against adapter-only ones.

Details: docs/internals/bench.md"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RANK = 32
ROUNDS = 5
REFIT_LAYERS = 4  # the wide bench model's layers for the refit sides (0.4 GiB in bf16)
SHAPES = {
    "qwen3_moe_210m": {
        "hidden_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 512,
        "intermediate_size": 2048,
        "vocab_size": 32000,
    },
    "qwen3_moe_30b_a3b": {
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "vocab_size": 151936,
    },
}


def version_bytes(shape: dict) -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from shared.models.lora import apply_lora

    with torch.device("meta"):
        base = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, tie_word_embeddings=False))
    full = sum(p.numel() for p in base.parameters()) * 2  # bf16
    out = {"parameters": full // 2, "full_bytes": full}
    for name, experts in (("attention", False), ("attention_experts", True)):
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, tie_word_embeddings=False))
            adapted = apply_lora(model, RANK, 2.0 * RANK, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"], experts)
        adapter = sum(p.numel() for n, p in adapted.named_parameters() if ".lora_" in n) * 2
        out[name] = {"adapter_bytes": adapter, "adapter_over_full": round(adapter / full, 4)}
    return out


def _status_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _side(model_dir, side: str):
    from bench.trainer import wider_model
    from shared.models.lora import apply_lora

    model = wider_model(model_dir)
    if side == "lora":
        model = apply_lora(model, RANK, 2.0 * RANK, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"], True).train()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)


def step_peak(model_dir: str, side: str, rounds: int = ROUNDS) -> dict:
    """One side alone in this process: resident bytes with its model and batch loaded, and the
    high-water mark over a warm-up and `rounds` steps (reset to the loaded process first)."""
    from bench.trainer import rollouts
    from services.trainer.batch import collate
    from services.trainer.global_step import StepConfig, train_step

    torch.set_num_threads(1)
    batch = collate(rollouts(model_dir))
    model, optimizer = _side(model_dir, side)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    loaded = _status_bytes("VmRSS")
    for _ in range(rounds + 1):
        train_step(model, optimizer, None, batch, 8, StepConfig(mini_batches=2), version=0)
    peak = _status_bytes("VmHWM")
    return {"loaded_bytes": loaded, "peak_bytes": peak, "step_peak_bytes": peak - loaded}


def peak_sides(model_dir, rounds: int = ROUNDS) -> dict:
    """Each side's `step_peak` in a process of its own (peaks of one process would mix)."""
    sides = {}
    for side in ("full", "lora"):
        done = subprocess.run(
            [sys.executable, "-m", "bench.lora", "peak", side, str(model_dir), str(rounds)],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if done.returncode:
            raise RuntimeError(f"the {side} side's peak run failed: {done.stderr[-2000:]}")
        sides[side] = json.loads(done.stdout.splitlines()[-1])
    return {
        "peak": sides,
        "lora_over_full_step_peak_bytes": round(sides["lora"]["step_peak_bytes"] / sides["full"]["step_peak_bytes"], 3),
        "lora_over_full_peak_bytes": round(sides["lora"]["peak_bytes"] / sides["full"]["peak_bytes"], 3),
    }


def step_sides(model_dir) -> dict:
    from bench.trainer import rollouts
    from services.trainer.batch import collate
    from services.trainer.global_step import StepConfig, train_step

    batch = collate(rollouts(model_dir))
    models = {}
    optimizers = {}
    for side in ("full", "lora"):
        models[side], optimizers[side] = _side(model_dir, side)
    seconds: dict[str, list[float]] = {"full": [], "lora": []}
    for _ in range(ROUNDS + 1):  # the first round warms both up, untimed
        for side, model in models.items():
            started = time.perf_counter()
            train_step(model, optimizers[side], None, batch, 8, StepConfig(mini_batches=2), version=0)
            seconds[side].append(time.perf_counter() - started)
    held = {}
    for side, model in models.items():
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        held[side] = params + 3 * trained  # + gradient + AdamW's two moments
    full_s = statistics.median(seconds["full"][1:])
    lora_s = statistics.median(seconds["lora"][1:])
    return {
        "step_seconds": {"full": round(full_s, 4), "lora": round(lora_s, 4)},
        "lora_over_full_step_seconds": round(lora_s / full_s, 3),
        "held_bytes": held,
        "lora_over_full_held_bytes_identity": round(held["lora"] / held["full"], 3),
        **peak_sides(model_dir),
    }


def refit_sides(layers: int = REFIT_LAYERS, rounds: int = 3, warmup: int | None = None) -> dict:
    """Refit seconds, full against adapter-only versions, per transport (medians of `rounds`;
    `warmup` untimed rounds first, bench/weightsync.py's WARMUP unless given)."""
    import tempfile
    from pathlib import Path

    from bench.weightsync import WARMUP, bench_model, limits, refit_group, summarise

    with (
        tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as shm_tmp,
        tempfile.TemporaryDirectory() as disk_tmp,
    ):
        model_dir, nbytes = bench_model(Path(disk_tmp) / "model", layers)
        memcpy = limits(nbytes, rounds, names=("memcpy",))["memcpy"]
        raw = {
            side: refit_group("torch", 1, model_dir, rounds, Path(shm_tmp), rank, WARMUP if warmup is None else warmup)
            for side, rank in (("full", 0), ("lora", RANK))
        }
    sides = {side: {t: summarise(results, nbytes, memcpy) for t, results in by_t.items()} for side, by_t in raw.items()}
    return {
        "model": {"layers": layers, "bytes": nbytes},
        "memcpy_seconds": round(memcpy, 4),
        "seconds": {side: {t: v["seconds"] for t, v in by_t.items()} for side, by_t in sides.items()},
        "lora_over_full_seconds": {
            t: round(sides["lora"][t]["seconds"] / sides["full"][t]["seconds"], 3) for t in sides["full"]
        },
        "paused_seconds": {side: {t: v["paused_seconds"] for t, v in by_t.items()} for side, by_t in sides.items()},
        "lora_over_full_paused_seconds": {
            t: round(sides["lora"][t]["paused_seconds"] / max(sides["full"][t]["paused_seconds"], 1e-6), 3)
            for t in sides["full"]
        },
    }


def main() -> dict:
    from shared.kit.tiny import init_tiny_model

    return {
        "benchmark": "lora",
        "rank": RANK,
        "rounds": ROUNDS,
        "targets": {"adapter_over_full": 0.05},
        "versions": {name: version_bytes(shape) for name, shape in SHAPES.items()},
        "trainer": step_sides(init_tiny_model()),
        "refit": refit_sides(),
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["peak"]:
        print(json.dumps(step_peak(sys.argv[3], sys.argv[2], int(sys.argv[4]))))
    else:
        print(json.dumps(main()))
