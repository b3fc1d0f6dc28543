"""What the trainer recorded about a run's work, read for the orchestrator, tests and operators
(the trainer is the only writer: `shared.runstore.keys`)."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from shared.runstore.keys import RunKeys


@dataclass(frozen=True)
class LedgerCounts:
    trained: int  # rollouts trained into a checkpoint
    dropped: int  # rollouts dropped as stale
    filtered: int  # rollouts of groups dynamic sampling filtered (equal rewards: no advantage)
    dead_groups: frozenset[str]  # groups (tasks) the trainer dead-lettered whole


class Ledger:
    def __init__(self, redis: Redis, run_id: str) -> None:
        self.redis = redis
        self.keys = RunKeys(run_id)

    async def counts(self) -> LedgerCounts:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.llen(self.keys.trained).llen(self.keys.dropped).llen(self.keys.filtered)
            pipe.smembers(self.keys.trained_dead)
            trained, dropped, filtered, dead = await pipe.execute()
        return LedgerCounts(int(trained), int(dropped), int(filtered), frozenset(g.decode() for g in dead))

    async def settled_groups(self, group_ids: list[str]) -> set[str]:
        """The groups among `group_ids` the ledger holds: trained, dropped or filtered (their first rollout,
        `group:0`, recorded: a group's ids are recorded together) or dead-lettered whole."""
        if not group_ids:
            return set()
        recorded = await self.redis.smismember(self.keys.trained_ids, [f"{g}:0" for g in group_ids])
        dead = await self.redis.smismember(self.keys.trained_dead, group_ids)
        return {g for g, r, d in zip(group_ids, recorded, dead, strict=True) if r or d}

    async def trained(self) -> list[str]:
        return [x.decode() for x in await self.redis.lrange(self.keys.trained, 0, -1)]

    async def dropped(self) -> list[str]:
        return [x.decode() for x in await self.redis.lrange(self.keys.dropped, 0, -1)]

    async def filtered(self) -> list[str]:
        return [x.decode() for x in await self.redis.lrange(self.keys.filtered, 0, -1)]

    async def rollouts_dead_counts(self) -> dict[str, int]:
        """Rollouts the trainer dead-lettered, by reason, since the run began."""
        return {k.decode(): int(v) for k, v in (await self.redis.hgetall(self.keys.rollouts_dead_counts)).items()}
