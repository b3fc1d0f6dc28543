"""The long-running processes of the end-to-end refit benchmark (bench/weightsync.py), timed round by round
(bench/clock.py `cycle`): `trainer` (fp32 master weights; each round an untimed optimizer step, then, on `go`, the
version published in bf16 by the round's transport through `make_publisher`) and `replica` (an engine with the
replica's weight subscriber; its `end` is the first token of the new version, and it samples its process tree's
memory meanwhile).

Details: docs/internals/bench.md"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import torch

from bench.protocol import end, ready

LR = 1e-6  # an RL learning rate: the share of bf16 elements it changes is what a delta carries
PROMPT = [5, 6, 7, 8]
SHM_KEEP = 2  # the trainer's shm files kept


def trainer(model_dir: str, address: str, shm_dir: str, lora_rank: str, signing_key: str) -> None:
    """`lora_rank` > 0: the trainer holds a LoRA adapter of that rank (attention and experts) over
    the frozen base, steps it and publishes adapter-only versions (`trainer.lora.publish = "adapter"`);
    every version signed with `signing_key`, as a run's trainer signs them."""
    from shared.models import load_causal_lm
    from shared.weightsync import TRANSPORTS, make_publisher
    from shared.weightsync.manifest import CastView
    from shared.weightsync.signing import Signer

    rank = int(lora_rank)
    model = load_causal_lm(model_dir, "float32")
    if rank:
        from shared.models.lora import adapter_config_json, adapter_state, apply_lora, base_digest
        from shared.rpc.steadyrl.v1.weightsync_pb2 import AdapterInfo

        model = apply_lora(model, rank, 2.0 * rank, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"], True)
        info = AdapterInfo(base_digest=base_digest(model_dir), config_json=adapter_config_json(model))
    params = {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n} if rank else model.state_dict()
    version_of = (
        (lambda: CastView(adapter_state(model), torch.bfloat16, info))
        if rank
        else (lambda: CastView(params, torch.bfloat16))
    )
    generator = torch.Generator().manual_seed(0)
    signs = {
        n: torch.randint(0, 2, t.shape, generator=generator, dtype=torch.int8).mul_(2).sub_(1)
        for n, t in params.items()
    }

    async def main() -> None:
        signer = Signer.from_file(Path(signing_key))
        publishers = {
            kind: make_publisher(kind, address, signer, shm_dir=Path(shm_dir), shm_keep=SHM_KEEP) for kind in TRANSPORTS
        }
        print('{"event": "started"}', flush=True)
        while line := await asyncio.to_thread(sys.stdin.readline):  # "step KIND VERSION", then publish on go
            _, kind, version = line.split()
            with torch.no_grad():
                for name, tensor in params.items():  # alternate directions: the weights stay where they are
                    tensor.add_(signs[name], alpha=LR if int(version) % 2 else -LR)
            await asyncio.to_thread(ready)
            await publishers[kind].push(version_of(), int(version), int(version) - 1, timeout=600)
            end(kind=kind)
        for publisher in publishers.values():
            await publisher.close()

    asyncio.run(main())


class TreeMemory:
    """Peak resident memory of a process and its descendants, sampled every 5 ms from /proc:
    private (anonymous) pages and shared-memory pages (the shm transport's file, mapped) apart."""

    FIELDS = ("RssAnon", "RssShmem")

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.base = self.peak = dict.fromkeys(self.FIELDS, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def tree(root: int) -> list[int]:
        pids = [root]
        children = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        for pid in pids:
            pids.extend(children.get(pid, []))
        return pids

    def sample(self) -> dict[str, int]:
        total = dict.fromkeys(self.FIELDS, 0)
        for pid in self.pids:
            try:
                lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                key, _, value = line.partition(":")
                if key in total:
                    total[key] += int(value.split()[0]) * 1024
        return total

    def start(self, root: int) -> None:
        self.pids = self.tree(root)
        self.base = self.peak = self.sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            now = self.sample()
            self.peak = {k: max(self.peak[k], now[k]) for k in self.FIELDS}

    def stop(self) -> dict[str, int]:
        """Bytes above the start: {"anon_peak_growth", "shmem_peak_growth", "anon_at_start"}."""
        self._stop.set()
        self._thread.join(5)
        return {
            "anon_peak_growth": self.peak["RssAnon"] - self.base["RssAnon"],
            "shmem_peak_growth": self.peak["RssShmem"] - self.base["RssShmem"],
            "anon_at_start": self.base["RssAnon"],
        }


def replica(engine_name: str, model_dir: str, address: str, name: str, verify_key: str) -> None:
    import os

    from shared.engines import Sampling, make_engine
    from shared.weightsync.signing import Verifier
    from shared.weightsync.subscriber import WatchSubscriber

    options = {"max_model_len": 64, "kv_cache_gib": 1.0} if engine_name == "vllm" else {"threads": 1}
    engine = make_engine(engine_name, model_dir, "bfloat16", **options)
    served: asyncio.Queue = asyncio.Queue()

    async def apply(delivery) -> float:  # as services/inference does, then the first token of it
        paused = await asyncio.to_thread(engine.apply, delivery)
        await asyncio.to_thread(engine.generate, [PROMPT], Sampling(temperature=0, max_new_tokens=1))
        served.put_nowait((delivery.version, time.monotonic(), paused, delivery.transport))
        return paused

    async def main() -> None:
        subscriber = WatchSubscriber(
            address,
            apply,
            name,
            transports=("shm", "collective", "grpc"),
            base=engine.weight_bytes,
            version=engine.version,
            verifier=Verifier.from_file(Path(verify_key)),
        )
        task = asyncio.create_task(subscriber.run())
        memory = TreeMemory()
        lines = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def read() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, "")  # closed: the benchmark is over

        threading.Thread(target=read, daemon=True).start()
        print('{"event": "started"}', flush=True)
        while line := await lines.get():  # "await VERSION": ready, then on go wait for its first token
            want = int(line.split()[1])
            print('{"event": "ready"}', flush=True)
            await lines.get()
            memory.start(os.getpid())
            wire = subscriber.wire_bytes
            while True:
                version, at, paused, transport = await served.get()
                if version >= want:
                    break
            end(
                at=at,
                version=version,
                transport=transport,
                paused_seconds=paused,
                wire_bytes=subscriber.wire_bytes - wire,
                **memory.stop(),
            )
        task.cancel()

    try:
        asyncio.run(main())
    finally:
        engine.close()
