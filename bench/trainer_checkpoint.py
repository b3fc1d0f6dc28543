"""Checkpoint benchmark: FSDP2 on 2 gloo ranks (this machine's CPU), the wide Qwen3-MoE of `bench.trainer_memory`,
each side in fresh processes: full gather (the earlier format), DCP blocking, DCP async.

Per side: rank 0's private-memory growth during the save, the save's wall time, and the step time with and without
an async save being written, beside a memcpy and a file write + fsync of the same bytes. Then the R3 trace bytes per
token of a Qwen3-30B-A3B-shaped trace.

`python -m bench.trainer_checkpoint` (or `steadyrl bench trainer --checkpoint`). Prints one JSON object.

Details: docs/internals/bench.md"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.refit_roles import TreeMemory
from bench.trainer_memory import WIDE, local_bytes, rollouts, wide_model


@contextlib.contextmanager
def peak_growth():
    """This process's peak private (anonymous) memory above its start while the block runs
    (`bench.refit_roles.TreeMemory`, sampled every 5 ms); yields a dict filled on exit."""
    memory = TreeMemory()
    result = {}
    memory.start(os.getpid())
    try:
        yield result
    finally:
        result.update(memory.stop())


def worker(rank: int, world: int, port: int, side: str, root: str, out: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from services.trainer.batch import collate
    from services.trainer.checkpoint import flat_state, start_save
    from services.trainer.config import TrainerSettings
    from services.trainer.global_step import StepConfig, train_step
    from services.trainer.parallel import full_state, prepare
    from shared.models.routing import RoutingController
    from shared.runtime.distributed import exit_rank

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    torch.set_num_threads(1)
    model = wide_model()
    routing = RoutingController(model)
    wrapped = prepare(
        model,
        TrainerSettings(model_path="-", parallel={"mode": "fsdp"}, compute={"precision": "fp32"}),
        torch.device("cpu"),
        world,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = collate(rollouts())

    def step() -> float:
        started = time.perf_counter()
        train_step(wrapped, optimizer, routing, batch, 2, StepConfig(), 0, rank, world)
        return time.perf_counter() - started

    step()  # AdamW's state exists from here on
    plain = statistics.median(step() for _ in range(3))
    result: dict = {"step_seconds": plain}
    directory = Path(root) / side
    dist.barrier()
    if side == "full_gather":
        with peak_growth() as peak:
            started = time.perf_counter()
            model_state, optimizer_state = full_state(model, optimizer)
            if rank == 0:
                directory.mkdir(parents=True)
                save_file({k: v.contiguous() for k, v in model_state.items()}, str(directory / "model.safetensors"))
                save_file(
                    {
                        f"{name}::{key}": value
                        for name, entry in optimizer_state["state"].items()
                        for key, value in entry.items()
                        if value.dim()
                    },
                    str(directory / "optimizer.safetensors"),
                )
            del model_state, optimizer_state
            dist.barrier()
            result["save_seconds"] = time.perf_counter() - started
    elif side == "dcp_blocking":
        with peak_growth() as peak:
            started = time.perf_counter()
            flat, _ = flat_state(model, optimizer)
            start_save(directory, flat, group, asynchronous=False)
            result["save_seconds"] = time.perf_counter() - started
    else:  # dcp_async: the steps go on while the shards are written
        during = []
        saves = []
        staged = []
        with peak_growth() as peak:
            for i in range(3):
                started = time.perf_counter()
                flat, _ = flat_state(model, optimizer)
                future = start_save(Path(f"{directory}-{i}"), flat, group, asynchronous=True)
                staged.append(time.perf_counter() - started)
                del flat
                during.append(step())  # trains while the background thread writes
                future.result()
                saves.append(time.perf_counter() - started)
        result.update(
            step_seconds_during_save=statistics.median(during),
            stage_seconds=statistics.median(staged),
            save_seconds=statistics.median(saves),
        )
    result.update(
        rss_growth_bytes=peak["anon_peak_growth"],
        rss_at_start_bytes=peak["anon_at_start"],
        shard_bytes=sum(local_bytes(t) for t in flat_state(model, optimizer)[0].values()),
    )
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    exit_rank()


def machine_limits(nbytes: int, directory: str) -> dict:
    """memcpy and a plain write + fsync of `nbytes` into `directory`, best of 3."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    copies = []
    writes = []
    for _ in range(3):
        started = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - started)
        path = Path(directory) / "raw.bin"
        started = time.perf_counter()
        with open(path, "wb") as f:
            f.write(memoryview(src.numpy()))
            f.flush()
            os.fsync(f.fileno())
        writes.append(time.perf_counter() - started)
        path.unlink()
    return {
        "bytes": nbytes,
        "memcpy_seconds": min(copies),
        "write_fsync_seconds": min(writes),
        "write_bytes_per_s": nbytes / min(writes),
    }


def trace_bytes() -> dict:
    """R3 trace bytes per token on the wire for a Qwen3-30B-A3B-shaped trace (48 × top-8 of 128)."""
    import numpy as np

    from shared.rollouts.record import trace_message

    rng = np.random.default_rng(0)
    positions = 4096
    layers = 48
    top_k = 8
    experts = 128
    random = np.argsort(rng.random((positions, layers, experts)), axis=-1)[..., :top_k]
    repeated = random.copy()
    for t in range(1, positions):
        same = rng.random(layers) < 0.5
        repeated[t][same] = repeated[t - 1][same]
    out = {
        "shape": [positions, layers, top_k],
        "num_experts": experts,
        "uint16_bytes_per_token": layers * top_k * 2,  # an int64 engine trace before: the wide type
        "uint8_bytes_per_token": layers * top_k,
    }
    for name, trace in (("random", random), ("repeated_half", repeated)):
        started = time.perf_counter()
        message = trace_message(trace, experts)
        seconds = time.perf_counter() - started
        per_token = len(message.expert_ids) / positions
        out[name] = {
            "bytes_per_token": round(per_token, 1),
            "over_uint8": round(per_token / (layers * top_k), 3),
            "over_uint16": round(per_token / (layers * top_k * 2), 3),
            "encode_mb_per_s": round(trace.size / seconds / 1e6, 1),
        }
    return out


def main() -> dict:
    import torch.multiprocessing as mp

    from shared.runstore.redis_server import free_port

    out: dict = {"model": WIDE, "ranks": 2, "parallel": "fsdp"}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("full_gather", "dcp_blocking", "dcp_async"):
            path = os.path.join(tmp, f"{side}.json")
            mp.start_processes(
                worker, args=(2, free_port(), side, tmp, path), nprocs=2, join=True, start_method="spawn"
            )
            out[side] = [json.loads(Path(f"{path}.{r}").read_text()) for r in range(2)]
        shard = out["dcp_blocking"][0]["shard_bytes"]
        out["limits"] = machine_limits(shard, tmp)
    full, blocking, background = (out[s][0] for s in ("full_gather", "dcp_blocking", "dcp_async"))
    out.update(
        parameters=sum(p.numel() for p in wide_model().parameters()),
        rank0_rss_growth_dcp_over_full_gather=round(blocking["rss_growth_bytes"] / full["rss_growth_bytes"], 3),
        rank0_rss_growth_dcp_async_over_full_gather=round(
            background["rss_growth_bytes"] / full["rss_growth_bytes"], 3
        ),  # target <= 0.6
        step_during_async_save_over_plain=round(
            background["step_seconds_during_save"] / background["step_seconds"], 3
        ),  # target <= 1.2
        save_seconds={
            "full_gather": round(full["save_seconds"], 3),
            "dcp_blocking": round(blocking["save_seconds"], 3),
            "dcp_async_staging": round(background["stage_seconds"], 3),
            "dcp_async_until_written": round(background["save_seconds"], 3),
        },
        dcp_blocking_over_limit_write=round(blocking["save_seconds"] / out["limits"]["write_fsync_seconds"], 2),
        trace=trace_bytes(),
    )
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main()) + "\n")
