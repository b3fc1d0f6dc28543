"""`steadyrl run` restarts what crashes: the trainer SIGKILLed between two checkpoints of the
default recipe (checkpoint_every = 10), with no test harness restarting it. The run finishes on
its own, nothing is lost or trained twice, no rollout is refused as from the future, and the
versions the replicas serve are the trainer's."""

import asyncio
import json
import re
from pathlib import Path

import pytest
from redis.asyncio import Redis

from shared.runstore.keys import RunKeys
from shared.runstore.redis_server import RedisServer
from tests.chaos.test_faults import read_ledger
from tests.helpers import kill_mid_run

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
B = 4
G = 8


@pytest.mark.parametrize(
    "trainer_gpus",
    # slow on the CPU: the default suite has the supervisor restart a killed trainer in
    # tests/chaos/test_run_faults.py (as a checkpoint lands) and tests/chaos/test_faults.py
    [pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.gpu)],
)
def test_steadyrl_run_restarts_a_sigkilled_trainer_between_checkpoints(tmp_path, tiny_model_dir, trainer_gpus):
    """On the CPU, and with the trainer on a GPU (bf16-mixed: its checkpoint comes back onto CUDA)."""
    out = tmp_path / "run"
    settings = [
        f"run.steps={STEPS}",
        f"run.batch_prompts={B}",
        f"run.group_size={G}",
        "run.replicas=2",
        "orchestrator.evals.every=0",
        "inference.tasks.lease_seconds=3",
        "inference.tasks.per_batch=2",
        f"trainer.parallel.gpus={trainer_gpus}",
    ]
    run = kill_mid_run(ROOT / "configs" / "tiny-arith.toml", out, settings, 15, ["trainer"])
    killed_at, stderr = run.killed_at, run.stderr
    assert killed_at % 10, f"the kill must fall between checkpoints, it came at step {killed_at}"
    assert run.returncode == 0, stderr[-3000:]
    assert re.search(r"event=service_restarted service=trainer", stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == STEPS

    with RedisServer(out / "redis", appendonly=True) as redis:  # the run's Redis, from its AOF
        trained, dropped, dead, submitted, rollouts_dead = asyncio.run(read_ledger(redis.url, "tiny-arith"))
        dead_groups = asyncio.run(smembers(redis.url, RunKeys("tiny-arith").trained_dead))
    assert len(trained) == len(set(trained)) == STEPS * B * G  # nothing trained twice, nothing skipped
    final = sorted((out / "trainer" / "checkpoints").glob("step-*"))[-1]
    state = json.loads((final / "state.json").read_text())
    assert state["step"] == STEPS and len(state["consumed"]) == STEPS * B * G
    assert "future_version" not in rollouts_dead, rollouts_dead
    tasks = {rid.split(":")[0] for rid in trained}
    accounted = tasks | {rid.split(":")[0] for rid in dropped} | dead | dead_groups
    assert accounted == {f"train-{i}" for i in range(submitted)}  # every task: trained, dropped or dead
    # the restarted trainer continued past what it had published, and the replicas followed it
    trainer_log = (out / "logs" / "trainer.log").read_text()
    layouts = re.findall(r"event=trainer_layout rank=0 world=1 device=(\S+) precision=(\S+)", trainer_log)
    assert layouts == [("cuda:0", "bf16-mixed") if trainer_gpus else ("cpu", "fp32")] * 2  # started, restarted
    continued = re.search(
        r"event=version_continues checkpoint_version=(\d+) published=(\d+) version=(\d+)", trainer_log
    )
    # a step's metrics line is written before its weights are published: the kill may fall between
    assert continued and int(continued[1]) == killed_at // 10 * 10 and int(continued[2]) >= killed_at - 1
    assert int(continued[2]) > int(continued[1]) and int(continued[3]) == int(continued[2]) + 1
    final_version = state["version"]
    assert final_version == STEPS + int(continued[3]) - int(continued[1])
    assert summary["final_status"]["trainer_version"] == final_version
    assert set(summary["final_status"]["replica_versions"].values()) == {final_version}
    for log in (out / "logs").glob("inference-*.log"):
        versions = [int(v) for v in re.findall(r"event=weights_applied version=(\d+)", log.read_text())]
        assert versions == sorted(set(versions)) and versions[-1] == final_version, log.name


async def smembers(url: str, key: str) -> set[str]:
    redis = Redis.from_url(url)
    members = {m.decode() for m in await redis.smembers(key)}
    await redis.aclose()
    return members
