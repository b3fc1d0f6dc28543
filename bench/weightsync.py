"""Weight benchmark: one bf16 version moved by every weight transport and by the machine's limits,
all in one run, all on one clock (bench/clock.py: processes made ready first, timed from one
release to the version resident and verified at the receiver; bench/roles.py: each side).

Sides, on the same bytes (`gib`, bf16, 64 MiB tensors):
- memcpy: the version copied into resident memory in one process — the machine's limit;
- raw_socket_1 / raw_socket_2: loopback TCP from a sender process to 1 receiver, and to 2 at
  once (2 senders) — the baseline every transport is divided by (raw_socket_1);
- grpc_push: the trainer's push to the weight-sync service (chunked, digested, stored);
- grpc_pull_1: a replica's verified pull (one stream, tensor by tensor), loaded;
- shm: the trainer writes the version to /dev/shm (digesting it), then a replica maps it,
  verifies every digest and loads it — both sides in one figure (each half reported beside);
- collective_1 / collective_2: a gloo broadcast from the trainer to 1 and 2 replicas, verified, loaded.

Every process moves one version untimed before the timed one (long-running services' steady
state). Each side runs `rounds` times, the sides alternated within a round; the median is reported. Also
the seconds a 61 GB version (Qwen3-30B-A3B in bf16) would take at each measured rate, and the
size of a delta after one real AdamW step of the tiny model. Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.clock import ROOT, expect, spawn, timed
from bench.roles import synthetic_state

MODEL_30B_A3B_BF16_BYTES = 61e9  # Qwen3-30B-A3B in bf16: what one version of it weighs
BASELINE = "raw_socket_1"


def free_port() -> int:
    from shared.redis_server import free_port

    return free_port()


def raw_sockets(nbytes: int, receivers: int) -> dict:
    recvs = []
    for _ in range(receivers):
        port = free_port()
        recv = spawn("raw_recv", port, nbytes)
        expect(recv, "listening")
        recvs.append((recv, port))
    senders = [spawn("raw_send", port, nbytes) for _, port in recvs]
    return timed([[*senders, *(recv for recv, _ in recvs)]])


def collective(nbytes: int, receivers: int, manifest_path: Path) -> dict:
    port = free_port()
    world = receivers + 1
    return timed([[spawn("collective", rank, world, port, manifest_path, nbytes) for rank in range(world)]])


def shm(nbytes: int) -> dict:
    directory = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        writer = spawn("shm_write", tmp, nbytes)
        expect(writer, "warmed")  # its untimed version 0 is on disk: the reader warms up on it
        return timed([[writer], [spawn("shm_load", tmp, nbytes)]])


class WeightSync:
    """The weight-sync service in its own process, holding version 1 of the synthetic state."""

    def __init__(self, nbytes: int, versions: int) -> None:
        self.port = free_port()
        env = {**os.environ, "STEADYRL_WEIGHTSYNC_PORT": str(self.port), "STEADYRL_WEIGHTSYNC_METRICS_PORT": "0",
               "STEADYRL_WEIGHTSYNC_RETAIN_VERSIONS": str(versions),
               "STEADYRL_WEIGHTSYNC_MEMORY_VERSIONS": str(versions), "STEADYRL_LOG_LEVEL": "WARNING"}
        self.process = subprocess.Popen([sys.executable, "-m", "services.weightsync"], env=env, cwd=ROOT)
        self.address = f"127.0.0.1:{self.port}"
        asyncio.run(self._push_first(nbytes))

    async def _push_first(self, nbytes: int) -> None:
        from shared.weightsync.grpc import GrpcWeightPublisher

        publisher = GrpcWeightPublisher(self.address)
        await publisher.push(synthetic_state(nbytes), 1, timeout=600)
        await publisher.close()

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def measure(nbytes: int, rounds: int = 3) -> dict[str, dict]:
    """Every side's median seconds over `rounds` (and each shm half's)."""
    from shared.weightsync.manifest import describe

    with tempfile.TemporaryDirectory() as tmp:
        manifest_path = Path(tmp) / "manifest.pb"
        manifest_path.write_bytes(describe(synthetic_state(nbytes), 1, 0).SerializeToString())
        service = WeightSync(nbytes, 2 * rounds + 2)
        pushed = iter(range(2, 2 * rounds + 2, 2))
        try:
            sides = {
                "memcpy": lambda: timed([[spawn("memcpy", nbytes)]]),
                "raw_socket_1": lambda: raw_sockets(nbytes, 1),
                "raw_socket_2": lambda: raw_sockets(nbytes, 2),
                "grpc_push": lambda: timed([[spawn("grpc_push", service.address, nbytes, next(pushed))]]),
                "grpc_pull_1": lambda: timed([[spawn("grpc_pull", service.address, nbytes)]]),
                "shm": lambda: shm(nbytes),
                "collective_1": lambda: collective(nbytes, 1, manifest_path),
                "collective_2": lambda: collective(nbytes, 2, manifest_path),
            }
            runs: dict[str, list[dict]] = {name: [] for name in sides}
            for round_ in range(rounds):
                names = list(sides) if round_ % 2 == 0 else list(reversed(sides))
                for name in names:
                    runs[name].append(sides[name]())
        finally:
            service.close()
    out = {name: {"seconds": statistics.median(r["seconds"] for r in results)} for name, results in runs.items()}
    for half, index in (("trainer_write_digest", 0), ("replica_map_verify_load", 1)):
        out["shm"][half + "_seconds"] = statistics.median(r["stage_seconds"][index] for r in runs["shm"])
    return out


def delta_share_after_one_step(lrs: tuple[float, ...] = (1e-6, 1e-5, 1e-4)) -> dict[str, float]:
    """Wire bytes of a delta (vs the previous version) as a share of the full bf16 state."""
    from shared.models import load_causal_lm
    from shared.models.tiny import TinySpec, init_tiny_model, sft_batch
    from shared.models.tiny import char_tokenizer as tokenizer_factory
    from shared.weightsync.frames import encode_delta
    from shared.weightsync.manifest import digest, tensor_to_bytes

    path = init_tiny_model()
    task = TinySpec().task()
    ids, labels = sft_batch(tokenizer_factory(), task.split("train", 64))
    out = {}
    for lr in lrs:
        model = load_causal_lm(path, "float32").train()
        before = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        after = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        full = wire = 0
        for name, tensor in after.items():
            data, base = tensor_to_bytes(tensor), tensor_to_bytes(before[name])
            _, encoded = encode_delta(data, base, digest(data) == digest(base))
            full += len(data)
            wire += len(encoded)
        out[f"lr_{lr:g}"] = round(wire / full, 4)
    return out


def report(nbytes: int, seconds: dict[str, dict]) -> dict:
    """Rates, each side against the one raw-socket baseline and memcpy, and modelled 61 GB times."""
    raw, copy = seconds[BASELINE]["seconds"], seconds["memcpy"]["seconds"]
    sides = {}
    for name, measured in seconds.items():
        s = measured["seconds"]
        sides[name] = {"seconds": round(s, 4), "gib_per_s": round(nbytes / s / 1024**3, 3),
                       "to_raw_socket": round(raw / s, 3), "to_memcpy": round(copy / s, 3),
                       "modelled_seconds_61gb": round(MODEL_30B_A3B_BF16_BYTES / (nbytes / s), 1),
                       **{k: round(v, 4) for k, v in measured.items() if k != "seconds"}}
    return sides


def main(gib: float = 1.0, rounds: int = 3) -> dict:
    nbytes = int(gib * 1024**3) // (64 << 20) * (64 << 20)
    sides = report(nbytes, measure(nbytes, rounds))
    return {"benchmark": "weightsync", "payload_bytes": nbytes, "dtype": "bfloat16", "rounds": rounds,
            "baseline": BASELINE, "sides": sides,
            "tiny_bf16_delta_share_after_one_adamw_step": delta_share_after_one_step(),
            "targets": {"grpc_pull_1": 0.7, "collective_1": 0.9, "collective_2": 0.9, "shm": 1.0}}


if __name__ == "__main__":
    print(json.dumps(main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)))
