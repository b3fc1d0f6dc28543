"""The replicas' idle share per step, read from the idle time their heartbeats report (the
orchestrator keeps each replica's cumulative idle and uptime seconds in Redis): over the interval
between this step's reading and the last one that changed, averaged over the replicas. The
heartbeats come every second, so on sub-second steps the share lags; the run's mean does not."""

from __future__ import annotations

import asyncio
import logging

import redis.exceptions
from redis.asyncio import Redis

log = logging.getLogger("steadyrl.trainer")


class ReplicaIdle:
    def __init__(self, redis: Redis, key: str) -> None:
        self.redis = redis
        self.key = key
        self.last: dict[str, tuple[float, float]] = {}  # replica → (idle, uptime) at its last change
        self.shares: dict[str, float] = {}

    async def share(self) -> float | None:
        """The replicas' mean idle share now (None before any heartbeat, or when Redis does not
        answer within a second: the step goes on without it)."""
        try:
            raw = await asyncio.wait_for(self.redis.hgetall(self.key), 1.0)
        except (redis.exceptions.RedisError, TimeoutError) as exc:
            log.warning("event=replica_idle_unread error=%s", type(exc).__name__)
            return None
        readings = {}
        for replica, value in raw.items():
            try:
                idle, uptime = (float(x) for x in value.decode().split(","))
            except ValueError:
                continue
            readings[replica.decode()] = (idle, uptime)
        self.shares = {r: s for r, s in self.shares.items() if r in readings}  # gone replicas leave
        for replica, (idle, uptime) in readings.items():
            self.shares[replica] = self.update(replica, idle, uptime)
        return sum(self.shares.values()) / len(self.shares) if self.shares else None

    def update(self, replica: str, idle: float, uptime: float) -> float:
        last = self.last.get(replica)
        if last is None or uptime < last[1]:  # first seen, or restarted: since it started
            self.last[replica] = (idle, uptime)
            return idle / uptime if uptime > 0 else 1.0
        if uptime == last[1]:  # no heartbeat since: its last share
            return self.shares.get(replica, idle / uptime if uptime > 0 else 1.0)
        self.last[replica] = (idle, uptime)
        return min(max((idle - last[0]) / (uptime - last[1]), 0.0), 1.0)
