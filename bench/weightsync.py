"""Weight benchmark, end to end: a refit from the trainer's last optimizer step to every replica serving the new
version (its first token), per transport, with 1 and 2 replicas, on both engines, beside a memcpy of the same bytes
and a raw loopback socket, on one clock (bench/clock.py; the processes: bench/refit_roles.py).

The model: bench/trainer_memory.py's wide Qwen3-MoE with `layers` layers. WARMUP untimed versions per transport,
then `rounds` timed rounds, the transports alternated, the median reported. Prints one JSON object.

Details: docs/internals/bench.md"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.clock import ROOT, cycle, expect, send, spawn, stop, timed
from bench.refit_roles import SHM_KEEP

MODEL_30B_A3B_BF16_BYTES = 61e9  # Qwen3-30B-A3B in bf16: what one version of it weighs
TRANSPORTS = ("shm", "collective", "grpc")
WARMUP = SHM_KEEP + 1  # untimed rounds: a transport's first use, and the shm files' reuse ring filled
TARGETS = {"shm_to_memcpy": 0.25, "two_over_one": 0.8, "vllm_over_torch": 1.2, "anon_growth_over_bucket": 2.0}


def free_port() -> int:
    from shared.runstore.redis_server import free_port

    return free_port()


def bench_model(directory: Path, layers: int) -> tuple[Path, int]:
    """The wide Qwen3-MoE with `layers` layers saved in bf16; (its directory, its bytes)."""
    from bench.trainer_memory import wide_model

    model = wide_model(num_hidden_layers=layers).to(torch.bfloat16)
    model.save_pretrained(directory)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    del model
    return directory, nbytes


class WeightSync:
    """The weight-sync service in its own process."""

    def __init__(self, shm_dir: Path, spill_dir: Path, verify_key: Path) -> None:
        self.port = free_port()
        env = {
            **os.environ,
            "STEADYRL_WEIGHTSYNC_PORT": str(self.port),
            "STEADYRL_WEIGHTSYNC_METRICS_PORT": "0",
            "STEADYRL_WEIGHTSYNC_VERIFY_KEY_FILE": str(verify_key),
            "STEADYRL_WEIGHTSYNC_RETAIN_VERSIONS": "2",
            "STEADYRL_WEIGHTSYNC_MEMORY_VERSIONS": "2",
            "STEADYRL_WEIGHTSYNC_SHM_DIR": str(shm_dir),
            "STEADYRL_WEIGHTSYNC_SPILL_DIR": str(spill_dir),
            "STEADYRL_LOG_LEVEL": "WARNING",
            "OMP_NUM_THREADS": "1",
        }
        self.process = subprocess.Popen([sys.executable, "-m", "services.weightsync"], env=env, cwd=ROOT)
        self.address = f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def refit_group(
    engine: str, replicas: int, model_dir: Path, rounds: int, tmp: Path, lora_rank: int = 0, warmup: int = WARMUP
) -> dict[str, list[dict]]:
    """Every transport's timed rounds for one engine × replica count: {transport: [cycle result]}
    (`lora_rank` > 0: the trainer publishes adapter-only versions of that rank; `warmup`: untimed
    rounds first, fewer than WARMUP only where no steady state is measured — the suite's runs)."""
    from shared.weightsync.signing import write_key_pair

    shm_dir = tmp / f"shm-{engine}-{replicas}"
    private, public = write_key_pair(tmp / f"keys-{engine}-{replicas}")  # signed and checked, as deployed
    service = WeightSync(shm_dir, tmp / f"spill-{engine}-{replicas}", public)
    processes = []
    try:
        trainer = spawn("trainer", model_dir, service.address, shm_dir / "run", lora_rank, private)
        members = [
            spawn("replica", engine, model_dir, service.address, f"{engine}-{i}", public) for i in range(replicas)
        ]
        processes = [trainer, *members]
        for process in processes:
            expect(process, "started")
        version = 0
        out: dict[str, list[dict]] = {t: [] for t in TRANSPORTS}
        order = [list(TRANSPORTS) if r % 2 == 0 else list(reversed(TRANSPORTS)) for r in range(warmup + rounds)]
        for round_, transports in enumerate(order):
            for transport in transports:
                version += 1
                send([trainer], f"step {transport} {version}")
                send(members, f"await {version}")
                result = cycle(processes)
                if round_ >= warmup:
                    out[transport].append(result)
        return out
    finally:
        stop(processes)
        service.close()
        shutil.rmtree(shm_dir, ignore_errors=True)  # the trainer's files: the next group's memory


def limits(
    nbytes: int,
    rounds: int,
    shm_dir: Path | None = None,
    names: tuple[str, ...] = ("memcpy", "raw_socket_1", "blake3_1_thread", "shm_floor"),
) -> dict[str, float]:
    """The machine's limits on the same bytes, median seconds: memcpy, one raw loopback socket, one
    BLAKE3 pass on one thread, and (given a directory in shared memory) the shm transport's own
    work alone — cast, write and hash, then map, check and copy (`shm_floor`): what the shm refit
    could reach here with nothing around it."""

    def raw_socket() -> dict:
        port = free_port()
        receiver = spawn("raw_recv", port, nbytes)
        expect(receiver, "listening")
        return timed([[spawn("raw_send", port, nbytes), receiver]])

    def floor() -> dict:
        with tempfile.TemporaryDirectory(dir=shm_dir) as directory:
            return timed([[spawn("shm_floor", nbytes, directory)]])

    sides = {
        "memcpy": lambda: timed([[spawn("memcpy", nbytes)]]),
        "raw_socket_1": raw_socket,
        "blake3_1_thread": lambda: timed([[spawn("blake3_pass", nbytes)]]),
    }
    if shm_dir is not None:
        sides["shm_floor"] = floor
    return {
        name: statistics.median(side()["seconds"] for _ in range(rounds))
        for name, side in sides.items()
        if name in names
    }


def summarise(results: list[dict], nbytes: int, memcpy: float) -> dict:
    """One side's rounds: median seconds, per GiB, against memcpy, and the replicas' reports."""
    seconds = statistics.median(r["seconds"] for r in results)
    replicas = [rep for r in results for rep in r["reports"][1:]]
    return {
        "seconds": round(seconds, 4),
        "seconds_per_gib": round(seconds / (nbytes / 1024**3), 4),
        "to_memcpy": round(memcpy / seconds, 3),
        "trainer_publish_seconds": round(statistics.median(r["reports"][0]["at"] - r["started"] for r in results), 4),
        "modelled_seconds_61gb": round(MODEL_30B_A3B_BF16_BYTES / (nbytes / seconds), 1),
        "paused_seconds": round(statistics.median(rep["paused_seconds"] for rep in replicas), 4),
        "wire_bytes_share": round(statistics.median(rep["wire_bytes"] for rep in replicas) / nbytes, 4),
        "anon_peak_growth_bytes": max(rep["anon_peak_growth"] for rep in replicas),
        "shmem_peak_growth_bytes": max(rep["shmem_peak_growth"] for rep in replicas),
        "transports": sorted({rep["transport"] for rep in replicas}),
    }


def ratios(refit: dict, bucket: int, machine: dict[str, float]) -> dict:
    """The figures the targets name, each side divided by its counterpart measured in this run; and
    `shm_to_floor`: the shm transport's own work alone (`shm_floor`) / the shm refit, 1 replica —
    the share of the refit that is the transport's bytes, the rest being the system around them."""
    out: dict = {
        "two_over_one": {},
        "vllm_over_torch": {},
        "shm_to_memcpy": {},
        "shm_to_floor": {},
        "anon_growth_over_bucket": {},
    }
    for engine, by_count in refit.items():
        out["shm_to_memcpy"][engine] = by_count.get("1", {}).get("shm", {}).get("to_memcpy")
        if "shm_floor" in machine and "shm" in by_count.get("1", {}):
            out["shm_to_floor"][engine] = round(machine["shm_floor"] / by_count["1"]["shm"]["seconds"], 3)
        if "1" in by_count and "2" in by_count:  # rates: 2 replicas served at seconds_1 / seconds_2 of 1's
            out["two_over_one"][engine] = {
                t: round(by_count["1"][t]["seconds"] / by_count["2"][t]["seconds"], 3) for t in TRANSPORTS
            }
        out["anon_growth_over_bucket"][engine] = {
            f"{count}:{t}": round(side["anon_peak_growth_bytes"] / bucket, 3)
            for count, sides in by_count.items()
            for t, side in sides.items()
        }
    if "torch" in refit and "vllm" in refit:
        for count in set(refit["torch"]) & set(refit["vllm"]):
            out["vllm_over_torch"][count] = {
                t: round(refit["vllm"][count][t]["seconds"] / refit["torch"][count][t]["seconds"], 3)
                for t in TRANSPORTS
            }
    return out


def delta_share_after_one_step(lrs: tuple[float, ...] = (1e-6, 1e-5, 1e-4)) -> dict[str, float]:
    """Wire bytes of a delta (vs the previous version) as a share of the full bf16 state."""
    from shared.kit.tiny import TinySpec, init_tiny_model, sft_batch
    from shared.kit.tiny import char_tokenizer as tokenizer_factory
    from shared.models import load_causal_lm
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
            data = tensor_to_bytes(tensor)
            base = tensor_to_bytes(before[name])
            _, encoded = encode_delta(data, base, digest(data) == digest(base))
            full += len(data)
            wire += len(encoded)
        out[f"lr_{lr:g}"] = round(wire / full, 4)
    return out


def main(
    layers: int = 11,
    rounds: int = 3,
    engines: tuple[str, ...] = ("torch", "vllm"),
    replicas: tuple[int, ...] = (1, 2),
    warmup: int = WARMUP,
) -> dict:
    from shared.weightsync.base import BUCKET_BYTES

    with (
        tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as shm_tmp,
        tempfile.TemporaryDirectory() as disk_tmp,
    ):
        model_dir, nbytes = bench_model(Path(disk_tmp) / "model", layers)
        machine = limits(nbytes, rounds, Path(shm_tmp))
        raw: dict = {}
        for engine in engines:
            for count in replicas:
                raw.setdefault(engine, {})[str(count)] = refit_group(
                    engine, count, model_dir, rounds, Path(shm_tmp), warmup=warmup
                )
    refit = {
        engine: {
            count: {t: summarise(results, nbytes, machine["memcpy"]) for t, results in sides.items()}
            for count, sides in by_count.items()
        }
        for engine, by_count in raw.items()
    }
    return {
        "benchmark": "weightsync",
        "model": {"layers": layers, "bytes": nbytes, "dtype": "bfloat16"},
        "bucket_bytes": BUCKET_BYTES,
        "rounds": rounds,
        "warmup_rounds": warmup,
        "lr": 1e-6,
        "machine": {
            name: {
                "seconds": round(s, 4),
                "gib_per_s": round(nbytes / s / 1024**3, 3),
                "to_memcpy": round(machine["memcpy"] / s, 3),
            }
            for name, s in machine.items()
        },
        "refit": refit,
        "ratios": ratios(refit, BUCKET_BYTES, machine),
        "targets": TARGETS,
        "tiny_bf16_delta_share_after_one_adamw_step": delta_share_after_one_step(),
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 11, int(sys.argv[2]) if len(sys.argv) > 2 else 3)))
