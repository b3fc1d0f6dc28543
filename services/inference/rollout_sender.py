"""A replica's sending of rollouts: each finished task's rollouts and the end of its lease in one
Redis call (`WorkQueue.complete_many`), tasks batched while a call is out and while a burst of
tasks is finishing (`services.inference.finishing`).

A send Redis does not answer (frozen, restarting) is tried again as soon as it answers — at most
a second apart — the rollouts kept and the leases still renewed by the worker, so no task waits
for its lease to expire; its outcome was unknown, so a retry that finds the task completed under
this replica's own lease stamp knows the first try landed and never sends it twice. One Redis
refuses (a script error, out of memory) requeues its tasks at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.exceptions
from prometheus_client import Counter

from shared.runstore.queues import Lease, WorkQueue

log = logging.getLogger("steadyrl.inference.worker")
SENT = Counter("steadyrl_inference_rollouts_sent_total", "Rollouts sent to the rollout stream", ["replica"])
LEASES_LOST = Counter(
    "steadyrl_inference_leases_lost_total", "Tasks finished after their lease was taken away", ["replica"]
)
QUEUE_ERRORS = Counter("steadyrl_inference_queue_errors_total", "Redis errors of the rollout loop", ["replica"])


class RolloutSender:
    """Sends the rollouts of finished tasks (`add`) to the rollout stream, ending their leases."""

    def __init__(
        self,
        queue: WorkQueue,
        replica_id: str,
        held: set[str],
        requeue: Callable[[str, str], Awaitable[None]],
        settled: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.queue = queue
        self.settled = settled  # awaited before each send: the tasks finishing now join it (`Finishing`)
        self.replica_id = replica_id
        self.held = held
        self.requeue = requeue
        self.sent = 0
        self.ready = asyncio.Event()
        self._ready: list[tuple[Lease, list[bytes]]] = []
        self._unsure: set[str] = set()  # tasks whose send may have landed without its reply reaching us

    def add(self, lease: Lease, payloads: list[bytes]) -> None:
        self._ready.append((lease, payloads))
        self.ready.set()

    async def loop(self) -> None:
        """Send what is ready; while Redis does not answer, try again every second at most, the
        rollouts kept and their leases renewed (no task waits for its lease to expire)."""
        delay = 0.1
        while True:
            await self.ready.wait()
            if self.settled is not None:
                await self.settled()
            self.ready.clear()
            if await self.send():
                delay = 0.1
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
            self.ready.set()

    async def send(self) -> bool:
        """Send every finished task's rollouts in one Redis round trip. False when Redis did not
        answer: the batch stays ready for the next try. A task whose earlier try may have landed
        (the reply was lost) is recognised by its lease stamp in `completed`, never sent twice."""
        batch = self._ready
        self._ready = []
        if not batch:
            return True
        try:
            evals = {lease.task_id for lease, _ in batch if lease.task.is_eval}
            accepted = await self.queue.complete_many(
                self.replica_id, [(lease.task_id, payloads) for lease, payloads in batch], evals
            )
            unsure = [
                lease
                for (lease, _), ok in zip(batch, accepted, strict=True)
                if not ok and lease.task_id in self._unsure
            ]
            stamps = await self.queue.lease_stamps([lease.task_id for lease in unsure])
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:  # applied or not: unknown
            QUEUE_ERRORS.labels(self.replica_id).inc()
            log.warning("event=send_failed tasks=%d error=%s retry=true", len(batch), type(exc).__name__)
            self._ready = batch + self._ready
            self._unsure |= {lease.task_id for lease, _ in batch}
            return False
        except redis.exceptions.RedisError as exc:  # refused (a script error, out of memory): not applied
            QUEUE_ERRORS.labels(self.replica_id).inc()
            log.warning("event=send_refused tasks=%d error=%s detail=%s", len(batch), type(exc).__name__, exc)
            for lease, _ in batch:
                await self.requeue(lease.task_id, f"send refused: {type(exc).__name__}")
            return True
        landed = {
            lease.task_id for lease in unsure if stamps.get(lease.task_id) == f"{self.replica_id}|{lease.attempt}"
        }
        retried = {lease.task_id for lease, _ in batch} & self._unsure
        for (lease, payloads), ok in zip(batch, accepted, strict=True):
            self.held.discard(lease.task_id)
            self._unsure.discard(lease.task_id)
            if ok or lease.task_id in landed:
                SENT.labels(self.replica_id).inc(len(payloads))
                self.sent += len(payloads)
                if lease.task_id in retried:
                    log.info(
                        "event=send_retried task=%s landed=%s",
                        lease.task_id,
                        "earlier" if lease.task_id in landed else "now",
                    )
            else:
                LEASES_LOST.labels(self.replica_id).inc()
                log.warning("event=lease_lost task=%s attempt=%d", lease.task_id, lease.attempt)
        return True
