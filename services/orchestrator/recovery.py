"""What the orchestrator watches of Redis itself: its memory and evictions (for the alerts), and
its restarts, after which train tasks it lost whole are queued again.

With appendfsync everysec a host crash takes the last second of writes, and a task can come back
in no state at all — neither queued, leased, completed, trained, dropped nor dead (its completion
lost while the replicas and the trainer moved on): counted outstanding forever, it would hold the
admission budget at 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import Counter, Gauge
from redis.asyncio import Redis

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.data import TRAIN_ID, Tasks
from shared.runstore.keys import RunField, RunKeys
from shared.runstore.ledger import Ledger
from shared.runstore.queues import WorkQueue, now_ms

log = logging.getLogger("steadyrl.orchestrator")

LOST = Counter(
    "steadyrl_orchestrator_tasks_lost_total",
    "Train tasks Redis lost whole (a host crash), found by the sweep after a restart and queued again",
)
REDIS_MEMORY = Gauge(
    "steadyrl_orchestrator_redis_memory_bytes", "Redis's memory (INFO): used, and its maxmemory (0: none)", ["kind"]
)
REDIS_EVICTED = Gauge(
    "steadyrl_orchestrator_redis_evicted_keys", "Keys Redis evicted since it started (INFO evicted_keys)"
)
INFO_EVERY_MS = 2000  # Redis's INFO read at most this often
LOST_CHECK_SECONDS = 60.0
LOST_CHECK_EVERY = 5.0  # after Redis restarts: look for lost tasks this long, this often


class RedisWatch:
    def __init__(
        self,
        settings: OrchestratorSettings,
        redis: Redis,
        queue: WorkQueue,
        ledger: Ledger,
        tasks: Tasks,
        version: Callable[[], int],
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.queue = queue
        self.ledger = ledger
        self.tasks = tasks
        self.version = version  # the trainer's published version: what a re-queued task asks for at least
        self.keys = RunKeys(settings.run_id)
        self.redis_id = ""  # the redis-server's run id: a new one means it restarted, and may have lost writes
        self.lost_check_until = self.next_lost_check = 0.0
        self.checked_ms = 0

    async def tick(self) -> None:
        """Read INFO every INFO_EVERY_MS; after a restart (or this process's start, which may follow
        a crash too) look for lost train tasks every LOST_CHECK_EVERY s for LOST_CHECK_SECONDS."""
        if now_ms() - self.checked_ms >= INFO_EVERY_MS:
            self.checked_ms = now_ms()
            info = await self.redis.info()
            REDIS_MEMORY.labels("used").set(info.get("used_memory", 0))
            REDIS_MEMORY.labels("max").set(info.get("maxmemory", 0))
            REDIS_EVICTED.set(info.get("evicted_keys", 0))
            identity = str(info["run_id"])
            if identity != self.redis_id:
                if self.redis_id:
                    log.warning("event=redis_restarted")
                self.redis_id = identity
                self.lost_check_until = time.monotonic() + LOST_CHECK_SECONDS
        if time.monotonic() < self.lost_check_until and time.monotonic() >= self.next_lost_check:
            self.next_lost_check = time.monotonic() + LOST_CHECK_EVERY
            await self.requeue_lost()

    async def requeue_lost(self) -> int:
        """Queue again the recent train tasks (the last 4 × (max_staleness + 1 + lookahead_batches) × B
        submitted) Redis holds in no state at all; returns how many."""
        s = self.settings
        submitted = int((await self.redis.hget(self.keys.run, RunField.SUBMITTED)) or 0)
        window = 4 * (s.max_staleness + 1 + s.lookahead_batches) * s.batch_prompts
        ids = await self.queue.unknown("train-", max(0, submitted - window), submitted)
        if ids:
            settled = await self.ledger.settled_groups(ids)
            ids = [t for t in ids if t not in settled]
        if ids:
            dead = await self.queue.dead_task_ids()
            ids = [t for t in ids if t not in dead]
        if not ids:
            return 0
        tasks = [self.tasks.make_train(int(TRAIN_ID.match(t).group(1)), self.version()) for t in ids]
        queued = sum(await self.queue.submit_many(tasks))
        LOST.inc(queued)
        log.warning("event=lost_tasks_requeued count=%d tasks=%s", queued, ",".join(ids[:20]))
        return queued
