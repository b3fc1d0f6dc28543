"""Helpers several tests share: publishing rollouts the way replicas do."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from pathlib import Path

from shared.queues import WorkQueue
from shared.rollout import Rollout, encode_rollout
from shared.rpc.steadyrl.v1 import common_pb2


async def publish(redis, run_id: str, rollouts: list[Rollout], replica: str = "rec") -> None:
    """Publish rollouts through the work queue, as a replica does: each task's rollouts under the
    lease that completes it (a task is submitted, leased and completed per distinct task id)."""
    queue = WorkQueue(redis, run_id)
    by_task: dict[str, list[bytes]] = defaultdict(list)
    for r in rollouts:
        by_task[r.task_id].append(encode_rollout(dataclasses.replace(r, run_id=run_id)))
    for task_id, payloads in by_task.items():
        assert await queue.submit(common_pb2.PromptTask(task_id=task_id, run_id=run_id))
        [lease] = await queue.lease(replica, 600)
        assert lease.task_id == task_id
        assert await queue.complete(replica, task_id, payloads)


@contextlib.contextmanager
def running(config, out: Path, model_dir, past_version: int = 2):
    """The whole system of `config` on loopback (processes started by their pids), its run
    started and the trainer past `past_version`; every process stopped on the way out."""
    from steadyrl.launcher import Launch

    launch = Launch(config, out, str(model_dir))
    try:
        launch.start_all()
        launch.api("POST", "/v1/run/start")
        while launch.api("GET", "/v1/run")["trainer_version"] < past_version:
            time.sleep(0.02)
        yield launch
    finally:
        launch.stop_all()


def wait_until(launch, done, timeout: float = 300) -> dict:
    """Poll the control plane until done(status); the status then."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = launch.api("GET", "/v1/run")
        except Exception:  # noqa: BLE001 - the control plane may be reconnecting to Redis
            status = {}
        if status and done(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
