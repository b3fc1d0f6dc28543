"""LoRA against full fine-tuning, side by side in one run. Prints one JSON object.

- Bytes per version: what a version publishes (bf16) with `trainer.lora` today — the merged model,
  as many bytes as a full version — and what an adapter-only version would hold (the adapter's
  tensors), on a 30B-A3B-shaped Qwen3-MoE (built on the meta device: shapes only) and on a
  ~210 M-parameter one, at rank 32, attention only and with the experts.
- Trainer step (the bench trainer's wider tiny MoE, fp32, one process): seconds per global step,
  median of rounds alternating the two, and the parameter + gradient + AdamW bytes each holds
  (an identity of the shapes, marked as such).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

RANK, ROUNDS = 32, 5
SHAPES = {
    "qwen3_moe_210m": {"hidden_size": 768, "num_hidden_layers": 8, "num_attention_heads": 12, "num_key_value_heads": 4,
                       "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
                       "intermediate_size": 2048, "vocab_size": 32000},
    "qwen3_moe_30b_a3b": {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                          "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                          "moe_intermediate_size": 768, "intermediate_size": 6144, "vocab_size": 151936},
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
        out[name] = {"adapter_bytes": adapter, "adapter_over_full": round(adapter / full, 4),
                     "published_over_full_today": 1.0}  # versions are the merged model (no adapter-only path yet)
    return out


def step_sides(model_dir) -> dict:
    from bench.trainer import rollouts, wider_model
    from shared.batch import collate
    from shared.models.lora import apply_lora
    from shared.training import StepConfig, train_step

    batch = collate(rollouts(model_dir))
    models = {"full": wider_model(model_dir)}
    models["lora"] = apply_lora(wider_model(model_dir), RANK, 2.0 * RANK, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"],
                                True).train()
    optimizers = {side: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-6)
                  for side, m in models.items()}
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
    full_s, lora_s = statistics.median(seconds["full"][1:]), statistics.median(seconds["lora"][1:])
    return {"step_seconds": {"full": round(full_s, 4), "lora": round(lora_s, 4)},
            "lora_over_full_step_seconds": round(lora_s / full_s, 3),
            "held_bytes": held, "lora_over_full_held_bytes_identity": round(held["lora"] / held["full"], 3)}


def main() -> dict:
    from shared.models.tiny import init_tiny_model

    return {"benchmark": "lora", "rank": RANK, "rounds": ROUNDS, "targets": {"adapter_over_full": 0.05},
            "versions": {name: version_bytes(shape) for name, shape in SHAPES.items()},
            "trainer": step_sides(init_tiny_model())}


if __name__ == "__main__":
    print(json.dumps(main()))
