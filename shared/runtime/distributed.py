"""torch.distributed plumbing for the trainer: each rank's device, the process group (nccl on
CUDA, gloo on CPU), and rank 0's commands to the other ranks.

Commands and batches travel between ranks as protobuf bytes packed into a uint8 tensor (never
pickle, so no `broadcast_object_list`)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_device(setting: str = "auto") -> torch.device:
    """This process's device: `cuda:LOCAL_RANK` (made current) when asked for or when CUDA exists
    under "auto", else the CPU."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.compute.device = 'cuda' but no CUDA device is visible to this process")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_from_env(device: torch.device | None = None, timeout_seconds: float = 600.0) -> tuple[int, int]:
    """Join the process group torchrun describes (WORLD_SIZE > 1) with the backend of this rank's
    device (nccl for CUDA, gloo for CPU), every collective bounded by `timeout_seconds` (gloo
    raises past it; nccl's watchdog aborts the process); returns (rank, world)."""
    from datetime import timedelta

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        from shared.runtime.job_store import rank_store

        cuda = device is not None and device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            device_id=device if cuda else None,
            timeout=timedelta(seconds=timeout_seconds),
            **rank_store(timeout_seconds),  # a multi-node job's round at weight-sync (no store port), else env://
        )
    return dist.get_rank(), dist.get_world_size()


def exit_rank(code: int = 0) -> None:
    """End a rank process: wait for the others, leave the group, then exit without running C++
    static destructors — a gloo thread still being torn down there aborts the process ("terminate
    called without an active exception"), failing a rank whose work was done."""
    import logging
    import sys

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_payloads(payloads: list[bytes] | None, tag: int = 0, src: int = 0) -> tuple[list[bytes] | None, int]:
    """Send (on `src`) or receive a list of byte strings and an integer tag; None = stop."""
    device = _device()
    if dist.get_rank() == src:
        items = payloads or []
        header = torch.tensor([len(items) if payloads is not None else -1, tag], dtype=torch.long, device=device)
    else:
        header = torch.zeros(2, dtype=torch.long, device=device)
    dist.broadcast(header, src)
    count = int(header[0])
    tag = int(header[1])
    if count < 0:
        return None, tag
    if dist.get_rank() == src:
        lengths = torch.tensor([len(p) for p in items], dtype=torch.long, device=device)
        data = (
            torch.frombuffer(bytearray(b"".join(items)), dtype=torch.uint8).to(device)
            if items
            else torch.zeros(0, dtype=torch.uint8, device=device)
        )
    else:
        lengths = torch.zeros(count, dtype=torch.long, device=device)
    dist.broadcast(lengths, src)
    if dist.get_rank() != src:
        data = torch.zeros(int(lengths.sum()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src)
    raw = data.cpu().numpy().tobytes()
    out = []
    offset = 0
    for length in lengths.tolist():
        out.append(raw[offset : offset + length])
        offset += length
    return out, tag
