"""Soak: the whole system (2 replicas) held at full queue depth for STEADYRL_SOAK_MINUTES (default 10),
sampling every service's memory; then stopped. Reports memory growth per service and the work
ledger as JSON (run with -s), and holds the targets: no rollout trained twice, no task lost, no
service growing past 64 MiB after its first minute (the trainer and Redis: plus 1 KiB per rollout
trained, their dedupe set and ledger).

    pytest -m soak -s tests/soak            # not in the default run
"""

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from shared.runstore.keys import RunKeys
from shared.runstore.ledger import Ledger
from steadyrl.processes import Launch
from steadyrl.recipe import load_recipe

pytestmark = pytest.mark.soak
ROOT = Path(__file__).resolve().parents[2]
MINUTES = float(os.environ.get("STEADYRL_SOAK_MINUTES", "10"))
WARMUP_SECONDS = 60.0  # memory is compared from here: model loads, allocator pools and caches settle first


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (vLLM workers) in MiB, from /proc."""
    total = 0.0
    for task in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{task}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except FileNotFoundError:
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        direct = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []
    return direct + [g for c in direct for g in _children(c)]


async def ledger(url: str, run_id: str) -> dict:
    """Where every submitted task is: trained, dropped as stale, dead, still queued or leased, or with
    rollouts on the stream the trainer has not trained yet (a group cut by the stop)."""
    redis = Redis.from_url(url)
    keys = RunKeys(run_id)
    trained = await Ledger(redis, run_id).trained()
    dropped = {x.split(":")[0] for x in await Ledger(redis, run_id).dropped()}
    dead = {f[b"task_id"].decode() for _, f in await redis.xrange(keys.dead)}
    queued = {x.decode() for x in await redis.lrange(keys.pending, 0, -1)}
    queued |= {x.decode() for x in await redis.zrange(keys.leases, 0, -1)}
    on_stream = {f[b"task"].decode() for _, f in await redis.xrange(keys.rollouts)}
    rollouts_dead = await redis.xlen(keys.rollouts_dead)
    submitted = int(await redis.hget(keys.run, "submitted") or 0)
    await redis.aclose()
    tasks_trained = {rid.split(":")[0] for rid in trained}
    unaccounted = {f"train-{i}" for i in range(submitted)} - tasks_trained - dropped - dead - queued - on_stream
    return {
        "submitted": submitted,
        "rollouts_trained": len(trained),
        "duplicates": len(trained) - len(set(trained)),
        "tasks_trained": len(tasks_trained),
        "tasks_dropped_stale": len(dropped - tasks_trained),
        "tasks_dead": len(dead),
        "rollouts_dead": rollouts_dead,
        "tasks_queued_or_leased": len(queued),
        "tasks_on_stream": len(on_stream),
        "tasks_unaccounted": len(unaccounted),
    }


def test_soak(tmp_path, tiny_model_dir):
    config = load_recipe(
        ROOT / "configs" / "tiny-arith.toml",
        ["run.steps=0", "run.replicas=2", "orchestrator.evals.every=0", "trainer.checkpoint.every=10"],
    )
    launch = Launch(config, tmp_path, str(tiny_model_dir))
    samples: dict[str, list[tuple[float, float]]] = {}
    depth = []
    try:
        launch.start_all()
        launch.api("POST", "/v1/run/start")
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < MINUTES * 60:
            for s in launch.services:
                assert s.process.poll() is None, f"{s.name} exited with {s.process.returncode}"
                samples.setdefault(s.name, []).append((elapsed, rss_mib(s.process.pid)))
            samples.setdefault("redis", []).append((elapsed, rss_mib(launch.redis.process.pid)))
            depth.append(launch.api("GET", "/v1/run")["queue"]["pending"])
            time.sleep(5.0)
        status = launch.api("GET", "/v1/run")
        launch.api("POST", "/v1/run/stop")
        for s in reversed(launch.services):  # a clean stop: the trainer checkpoints and acknowledges
            s.process.terminate()
            s.process.wait(60)
        work = asyncio.run(ledger(launch.redis.url, config.run_id))
    finally:
        launch.stop_all()
    memory = {}
    for name, points in samples.items():
        settled = [mib for t, mib in points if t >= min(WARMUP_SECONDS, MINUTES * 30)]
        hours = max((points[-1][0] - min(WARMUP_SECONDS, MINUTES * 30)) / 3600, 1e-9)
        memory[name] = {
            "start_mib": round(settled[0], 1),
            "end_mib": round(settled[-1], 1),
            "peak_mib": round(max(mib for _, mib in points), 1),
            "growth_mib": round(settled[-1] - settled[0], 1),
            "growth_mib_per_hour": round((settled[-1] - settled[0]) / hours, 1),
        }
    report = {
        "minutes": MINUTES,
        "trainer_version": status["trainer_version"],
        "queue_pending_mean": round(sum(depth) / len(depth), 1),
        "queue_pending_min": min(depth),
        "memory": memory,
        "work": work,
    }
    print(json.dumps(report, indent=1))
    assert work["duplicates"] == 0 and work["tasks_unaccounted"] == 0
    assert work["rollouts_dead"] == 0 and work["tasks_dead"] == 0
    # the stream holds only work in flight (trained entries are deleted): at most the admission bound
    assert work["tasks_on_stream"] + work["tasks_queued_or_leased"] <= (1 + 1) * 32
    assert status["trainer_version"] > 0
    # memory: the trainer (its set of trained ids) and Redis (the ledger list) grow by design, linearly in
    # the rollouts trained; nothing else may grow past what allocators and caches settle to
    for name, used in memory.items():
        bound = 64 + (work["rollouts_trained"] / 1024 if name in ("trainer", "redis") else 0)  # 1 KiB a rollout
        assert used["growth_mib"] <= bound, (name, used, bound)
