"""Trainer memory benchmark: DDP vs FSDP2 on 2 gloo ranks (this machine's CPU), one global step
each on a random-init Qwen3-MoE far wider than the tiny one (hidden 1024, 64 experts, top-8,
4 layers). Per rank: the bytes of parameters + AdamW state it holds (FSDP / DDP is 1/world by construction)
and its peak resident memory (measured); the bytes a published version carries in bf16 against
fp32 (0.5 by construction) and the seconds the trainer takes to publish it to shared memory in
each (measured: cast, write, digest). Prints one JSON object.

`python -m bench.trainer_memory` (or `steadyrl bench trainer --memory`)."""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch

WIDE = dict(
    hidden_size=1024,
    num_experts=64,
    num_experts_per_tok=8,
    num_hidden_layers=4,
    moe_intermediate_size=256,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=256,
)


def wide_model(**overrides):
    """The wide random-init Qwen3-MoE in fp32 (`overrides`: config fields, e.g. more layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shared.kit.tiny import init_tiny_model

    config = AutoConfig.from_pretrained(init_tiny_model())
    for key, value in {**WIDE, **overrides}.items():
        setattr(config, key, value)
    config.max_position_embeddings = 128
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def rollouts(groups: int = 2, group: int = 2):
    import numpy as np

    from shared.rollouts.record import Rollout

    rng = np.random.default_rng(0)
    return [
        Rollout(
            rollout_id=f"t{g}:{i}",
            group_id=f"t{g}",
            task_id=f"t{g}",
            sample_index=i,
            group_size=group,
            prompt_token_ids=rng.integers(3, 250, 16).astype(np.int32),
            completion_token_ids=rng.integers(3, 250, 16).astype(np.int32),
            inference_logprobs=-rng.random(16, dtype=np.float32),
            policy_versions=np.zeros(16, np.uint64),
            reward=float(i % 2),
        )
        for g in range(groups)
        for i in range(group)
    ]


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def worker(rank: int, world: int, port: int, parallel: str, out: str) -> None:
    import torch.distributed as dist

    from services.trainer.batch import collate
    from services.trainer.config import TrainerSettings
    from services.trainer.global_step import StepConfig, train_step
    from services.trainer.parallel import prepare
    from shared.models.routing import RoutingController
    from shared.runtime.distributed import exit_rank
    from shared.weightsync.manifest import CastView, describe

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = wide_model()
    routing = RoutingController(model)
    settings = TrainerSettings(model_path="-", parallel={"mode": parallel}, compute={"precision": "fp32"})
    wrapped = prepare(model, settings, torch.device("cpu"), world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    train_step(wrapped, optimizer, routing, collate(rollouts()), 2, StepConfig(), 0, rank, world)
    held = sum(local_bytes(p) for p in model.parameters())
    held += sum(local_bytes(v) for state in optimizer.state.values() for v in state.values() if v.dim())
    result = {
        "rank": rank,
        "param_and_optimizer_bytes": held,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if rank == 0 and parallel == "ddp":
        import time

        from shared.weightsync.shm import write_shm

        state = model.state_dict()
        result["published_bytes"] = {
            dtype: sum(t.nbytes for t in describe(CastView(state, getattr(torch, dtype)), 1, 0).tensors)
            for dtype in ("float32", "bfloat16")
        }
        result["published_write_seconds"] = {}
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        with tempfile.TemporaryDirectory(dir=shm) as tmp:
            for dtype in ("float32", "bfloat16"):  # the trainer's shm publish: cast, write, digest
                started = time.perf_counter()
                write_shm(Path(tmp) / f"{dtype}.safetensors", CastView(state, getattr(torch, dtype)), 1, 0)
                result["published_write_seconds"][dtype] = round(time.perf_counter() - started, 4)
                (Path(tmp) / f"{dtype}.safetensors").unlink()
        result["parameters"] = sum(p.numel() for p in model.parameters())
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    exit_rank()


def main() -> dict:
    import torch.multiprocessing as mp

    from shared.runstore.redis_server import free_port

    out: dict = {"model": WIDE, "ranks": 2}
    with tempfile.TemporaryDirectory() as tmp:
        for parallel in ("ddp", "fsdp"):
            path = os.path.join(tmp, parallel)
            mp.start_processes(worker, args=(2, free_port(), parallel, path), nprocs=2, join=True, start_method="spawn")
            out[parallel] = [json.loads(Path(f"{path}.{r}").read_text()) for r in range(2)]
    ddp = max(r["param_and_optimizer_bytes"] for r in out["ddp"])
    fsdp = max(r["param_and_optimizer_bytes"] for r in out["fsdp"])
    published = out["ddp"][0].pop("published_bytes")
    written = out["ddp"][0].pop("published_write_seconds")
    out.update(
        parameters=out["ddp"][0].pop("parameters"),
        fsdp_over_ddp_param_optimizer_bytes=round(fsdp / ddp, 3),  # target <= 0.6
        fsdp_over_ddp_peak_rss=round(
            max(r["peak_rss_mib"] for r in out["fsdp"]) / max(r["peak_rss_mib"] for r in out["ddp"]), 3
        ),
        published_bytes=published,
        published_bf16_over_fp32=round(published["bfloat16"] / published["float32"], 3),  # an identity: 0.5
        published_write_seconds=written,  # measured
        published_bf16_over_fp32_write_seconds=round(written["bfloat16"] / written["float32"], 3),
    )
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main()) + "\n")
