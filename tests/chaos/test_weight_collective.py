"""The collective weight transport under faults: a replica SIGKILLed while versions are being
broadcast fails that broadcast, the group is formed again without it and the run finishes whole (how
long the trainer waited for it, against the timeout, is bench/faults.py's); a replica started mid-run
catches up by gRPC and joins the group."""

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import pytest

from steadyrl.recipe import load_recipe
from tests.chaos.test_faults import read_ledger
from tests.helpers import running, wait_until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
B = 4
G = 8
TIMEOUT = 5.0


def collective_config(replicas: int, steps: int = STEPS):
    return load_recipe(
        ROOT / "configs" / "tiny-arith.toml",
        [
            f"run.steps={steps}",
            f"run.batch_prompts={B}",
            f"run.group_size={G}",
            f"run.replicas={replicas}",
            "orchestrator.evals.every=0",
            "trainer.checkpoint.every=1",
            "inference.tasks.lease_seconds=3",
            "inference.tasks.per_batch=2",
            "trainer.publish.transport=collective",
            f"weightsync.collective_timeout_seconds={TIMEOUT}",
        ],
    )


def announcements(out: Path) -> list[str]:
    return re.findall(
        r"event=version_announced version=\d+ transport=collective epoch=\d+ members=2",
        (out / "logs" / "weightsync.log").read_text(),
    )


def test_a_replica_killed_during_broadcasts_fails_one_broadcast_and_loses_nothing(tmp_path, tiny_model_dir):
    config = collective_config(replicas=2)
    with running(config, tmp_path, tiny_model_dir, past_version=4) as launch:
        victim = next(s for s in launch.services if s.name == "inference-0")
        announced = len(announcements(tmp_path))
        os.kill(victim.process.pid, signal.SIGSTOP)  # the member stops answering...
        deadline = time.monotonic() + 60
        # ...the next version's broadcast waits on it (or the one announced just before the stop did,
        # and timed out already: the group is then formed again without it, members=1)...
        while (
            len(announcements(tmp_path)) <= announced
            and "members=1" not in (tmp_path / "logs" / "weightsync.log").read_text()
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)
        os.kill(victim.process.pid, signal.SIGKILL)  # ...and it dies in the middle of that broadcast
        victim.process.wait(10)
        victim.process = None
        wait_until(launch, lambda status: status["state"] == "finished")
        trained, dropped, dead, submitted, rollouts_dead = asyncio.run(read_ledger(launch.redis.url, config.run_id))
    assert len(trained) == len(set(trained)) == STEPS * B * G
    accounted = {r.split(":")[0] for r in trained} | {r.split(":")[0] for r in dropped} | dead
    assert accounted == {f"train-{i}" for i in range(submitted)}
    # a broadcast met the dead member: gloo broadcasts down a binomial tree, so the one sending to the dead
    # rank fails, the trainer (rank 0) or weight-sync (rank 1), by the order the replicas joined in...
    weightsync_log = (tmp_path / "logs" / "weightsync.log").read_text()
    failed = re.findall(
        r"event=collective_failed version=(\d+)", (tmp_path / "logs" / "trainer.log").read_text() + weightsync_log
    )
    assert failed  # ...and the run went on: every step trained, every version reached the survivor
    epochs = [int(e) for e in re.findall(r"transport=collective epoch=(\d+) members", weightsync_log)]
    assert epochs[-1] > epochs[0]  # the group was formed again without the dead replica
    survivor = (tmp_path / "logs" / "inference-1.log").read_text()
    versions = [int(v) for v in re.findall(r"event=weights_applied version=(\d+)", survivor)]
    assert versions == sorted(set(versions)) and versions[-1] == STEPS


def test_a_replica_started_mid_run_catches_up_and_joins(tmp_path, tiny_model_dir):
    config = collective_config(replicas=1, steps=150)
    with running(config, tmp_path, tiny_model_dir, past_version=10) as launch:
        template = next(s for s in launch.services if s.name == "inference-0")
        joined_at = launch.api("GET", "/v1/run")["trainer_version"]
        # the run is held while the joiner starts (a step takes ~0.1 s: 150 steps could end first)
        assert launch.api("POST", "/v1/run/pause")["state"] == "paused"
        joiner = launch.add_replica(template, "replica-late")
        launch.wait_healthy(joiner)
        wait_until(launch, lambda s: s["replica_versions"].get("replica-late", -1) >= joined_at, timeout=60)
        assert launch.api("POST", "/v1/run/resume")["state"] == "running"
        wait_until(launch, lambda s: s["state"] == "finished")
        # the replica reports its version on its heartbeat: the last one lands within a beat or two
        final = wait_until(launch, lambda s: s["replica_versions"].get("replica-late") == 150, timeout=30)
    late_log = (tmp_path / "logs" / "replica-late.log").read_text()
    received = [int(v) for v in re.findall(r"event=weights_(?:applied|staged) version=(\d+)", late_log)]
    assert joined_at < 150 and received[0] >= joined_at  # it caught up at once to the version current when it came
    assert set(range(received[0], 151)) <= set(received)  # and from then on received every version
    assert final["replica_versions"]["replica-late"] == 150
    received = re.findall(
        r"version_announced version=\d+ transport=collective epoch=\d+ members=2",
        (tmp_path / "logs" / "weightsync.log").read_text(),
    )
    assert received  # after catching up it received versions as a member of the group
