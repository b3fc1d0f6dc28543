"""Helpers several tests share: publishing rollouts the way replicas do."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

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
