"""The trainer's side of the rollout stream (`RedisRolloutSource`, a `shared.rollouts.interfaces.RolloutSource`):
the Redis consumer group, settlements and dead letters.

Settling is idempotent: a reply can be lost after Redis applied a script (Redis going down),
and the trainer then settles the same entries again; the ledger still lists each id once.
"""

from __future__ import annotations

import logging

import redis.exceptions
from redis.asyncio import Redis

from shared.rollouts.interfaces import RolloutSource
from shared.runstore.keys import RunKeys

log = logging.getLogger("steadyrl.trainer")
GROUP = "trainer"
DEAD_PAYLOAD_BYTES = 1 << 20  # a dead-lettered rollout keeps at most this much of its payload

# Settle stream entries: XACK + XDEL each, and record its rollout id in a ledger list, atomically.
# KEYS: stream, ledger list ('' for none), the set of ids the ledger holds. ARGV: group, mode, then
# (entry id | '', rollout id) pairs. mode 'trained', 'dropped' or 'filtered': an id is appended once ever (the
# set guards it; '' entries restore ids Redis lost). mode 'none': acknowledge only.
_SETTLE = """
local group, mode, added = ARGV[1], ARGV[2], 0
for i = 3, #ARGV, 2 do
  local entry, rid = ARGV[i], ARGV[i + 1]
  if entry ~= '' then
    redis.call('XACK', KEYS[1], group, entry)
    redis.call('XDEL', KEYS[1], entry)
  end
  local record = mode ~= 'none' and redis.call('SADD', KEYS[3], rid) == 1
  if record then
    redis.call('RPUSH', KEYS[2], rid)
    added = added + 1
  end
end
return added
"""
# Dead-letter an entry once: only while it is still pending (a repeat after a lost reply is a
# no-op). The dead-letter stream keeps the newest ARGV[6] entries; the counts hash keeps every
# reason; the group of a poisoned rollout (ARGV[7], '' for none) joins the set of dead groups.
# KEYS: stream, dead stream, counts, dead groups. ARGV: group, entry, reason, message, payload, maxlen, group id
_DEAD_LETTER = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'entry', ARGV[2], 'reason', ARGV[3], 'message', ARGV[4],
    'r', ARGV[5])
  redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
end
if ARGV[7] ~= '' then redis.call('SADD', KEYS[4], ARGV[7]) end
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""


class RedisRolloutSource(RolloutSource):
    """The run's rollout stream read through the trainer's consumer group."""

    def __init__(
        self,
        redis: Redis,
        run_id: str,
        consumer: str,
        dead_maxlen: int = 10_000,
        dead_payload_bytes: int = DEAD_PAYLOAD_BYTES,
    ) -> None:
        self.redis = redis
        self.consumer = consumer
        self.keys = RunKeys(run_id)
        self.dead_maxlen = dead_maxlen
        self.dead_payload_bytes = dead_payload_bytes
        self._settle = redis.register_script(_SETTLE)
        self._dead_letter = redis.register_script(_DEAD_LETTER)

    async def open(self) -> None:
        """Create the consumer group if it does not exist."""
        try:
            await self.redis.xgroup_create(self.keys.rollouts, GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, block_ms: int, count: int = 512) -> list:
        reply = await self.redis.xreadgroup(
            GROUP, self.consumer, {self.keys.rollouts: ">"}, count=count, block=block_ms
        )
        return reply[0][1] if reply else []

    async def claim(self, start: bytes | str = "0-0", count: int = 512) -> tuple[bytes | str, list]:
        """One page of entries a previous consumer read but never acknowledged (next start, entries)."""
        reply = await self.redis.xautoclaim(self.keys.rollouts, GROUP, self.consumer, 0, start, count=count)
        return reply[0], reply[1]

    async def stamps(self, entries: list) -> dict[str, str | None]:
        """The lease that completed each task these entries name (`shared.runstore.queues`)."""
        tasks = sorted({f[b"task"].decode(errors="replace") for _, f in entries if f and b"task" in f})
        if not tasks:
            return {}
        values = await self.redis.hmget(self.keys.completed, tasks)
        return {t: (v.decode() if v is not None else None) for t, v in zip(tasks, values, strict=True)}

    async def settle(self, items: list[tuple[bytes | str, str]], ledger: str = "", mode: str = "trained") -> int:
        """XACK and delete entries and append their ids to `ledger`, atomically and idempotently
        (see _SETTLE). Deleting keeps the stream as long as the work in flight, not the whole run
        (a 30B-A3B rollout with its routing trace is ~0.9 MB). Returns how many ids were appended."""
        if not items:
            return 0
        args = [GROUP, mode] + [x for entry, rid in items for x in (entry, rid)]
        return int(await self._settle(keys=[self.keys.rollouts, ledger, self.keys.trained_ids], args=args))

    async def trained(self, items: list[tuple[bytes | str, str]]) -> int:
        """Acknowledge trained entries into the ledger (each id once, ever)."""
        return await self.settle(items, self.keys.trained, "trained")

    async def duplicates(self, items: list[tuple[bytes, str]]) -> None:
        await self.settle(items, "", "none")

    async def dropped(self, items: list[tuple[bytes | str, str]]) -> int:
        """Acknowledge entries dropped as stale into the ledger (each id once, ever)."""
        return await self.settle(items, self.keys.dropped, "dropped")

    async def filtered(self, items: list[tuple[bytes | str, str]]) -> int:
        """Acknowledge the entries of groups dynamic sampling filtered into the ledger (each id once, ever)."""
        return await self.settle(items, self.keys.filtered, "filtered")

    async def dead_letter(self, entry: bytes, reason: str, message: str, payload: bytes, group: str = "") -> None:
        payload = payload[: self.dead_payload_bytes]
        await self._dead_letter(
            keys=[self.keys.rollouts, self.keys.rollouts_dead, self.keys.rollouts_dead_counts, self.keys.trained_dead],
            args=[GROUP, entry, reason, message[:1000], payload, self.dead_maxlen, group],
        )

    async def dead_groups(self) -> set[str]:
        return {x.decode() for x in await self.redis.smembers(self.keys.trained_dead)}

    async def identity(self) -> str:
        """The redis-server process's run id: a new one means Redis restarted (and may have lost writes)."""
        return str((await self.redis.info("server"))["run_id"])
