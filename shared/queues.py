"""The Redis work queue of prompt tasks (with leases) and the rollout stream (`shared.keys` names
every key).

Every state change is one Lua script, so a replica that dies at any point leaves the task either
pending, leased (its lease expires, `requeue_expired` puts it back) or completed — never half.
`complete` publishes all G rollouts of a task and ends its lease in one step, and only while the
caller still owns the lease: a replica whose lease was taken away publishes nothing, so each task
reaches the stream exactly once. Each published entry carries the lease that produced it
(`replica|attempt`, stamped by the script, also recorded in `completed`), so the trainer can tell
a real rollout from a stray or replayed entry.

A task that cannot be served (undecodable, invalid, a version that never comes) goes to the `dead`
stream with a reason code and a message; `dead:counts` counts every code for good, while the
stream itself keeps only the newest `dead_maxlen` entries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from redis.asyncio import Redis

from shared.interfaces import RolloutSink
from shared.keys import RunKeys
from shared.rpc.steadyrl.v1 import common_pb2

_SUBMIT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

# KEYS: pending leases owners tasks attempts; ARGV: now_ms lease_ms replica count
_LEASE = """
local out = {}
for i = 1, tonumber(ARGV[4]) do
  local id = redis.call('RPOP', KEYS[1])
  if not id then break end
  local task = redis.call('HGET', KEYS[4], id)
  if task then
    redis.call('ZADD', KEYS[2], tonumber(ARGV[1]) + tonumber(ARGV[2]), id)
    redis.call('HSET', KEYS[3], id, ARGV[3])
    table.insert(out, id)
    table.insert(out, task)
    table.insert(out, redis.call('HGET', KEYS[5], id) or '0')
  end
end
return out
"""

# KEYS: leases owners; ARGV: now_ms lease_ms replica id...
_EXTEND = """
local kept = 0
for i = 4, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[3] then
    redis.call('ZADD', KEYS[1], 'XX', tonumber(ARGV[1]) + tonumber(ARGV[2]), ARGV[i])
    kept = kept + 1
  end
end
return kept
"""

# KEYS: leases owners tasks attempts completed stream errors; ARGV: id replica r1 ... rN.
# Each entry carries the lease stamp (`replica|attempt` of the lease being completed) and n, the
# number of rollouts published together.
_COMPLETE = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return -1 end
local stamp = ARGV[2] .. '|' .. (redis.call('HGET', KEYS[4], ARGV[1]) or '0')
local n = tostring(#ARGV - 2)
for i = 3, #ARGV do
  redis.call('XADD', KEYS[6], '*', 'task', ARGV[1], 'lease', stamp, 'n', n, 'r', ARGV[i])
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
redis.call('HSET', KEYS[5], ARGV[1], stamp)
return #ARGV - 2
"""

# KEYS: leases owners errors; ARGV: id replica reason. Ends the lease now; the next sweep counts
# the attempt (and names the reason if the task runs out of attempts).
_FAIL = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], 0, ARGV[1])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[3], ARGV[1], ARGV[3]) end
return 1
"""

# KEYS: leases owners attempts pending tasks dead errors dead_counts pending:policy;
# ARGV: now_ms max_attempts maxlen policy_eval_prefix (a task whose id starts with it goes back to
# the policy-eval pool's list)
_REQUEUE = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local requeued, dead = 0, 0
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  local owner = redis.call('HGET', KEYS[2], id) or ''
  redis.call('HDEL', KEYS[2], id)
  local attempts = redis.call('HINCRBY', KEYS[3], id, 1)
  if attempts > tonumber(ARGV[2]) then
    local task = redis.call('HGET', KEYS[5], id) or ''
    local last = redis.call('HGET', KEYS[7], id)
    local message = 'lease expired or failed ' .. attempts .. ' times (last replica ' .. owner .. ')'
    if last then message = message .. '; last error: ' .. last end
    redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[3], '*', 'task_id', id, 'code', 'attempts',
      'reason', 'attempts: ' .. message, 'task', task)
    redis.call('HINCRBY', KEYS[8], 'attempts', 1)
    redis.call('HDEL', KEYS[5], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('HDEL', KEYS[7], id)
    dead = dead + 1
  elseif string.sub(id, 1, #ARGV[4]) == ARGV[4] then
    redis.call('RPUSH', KEYS[9], id)
    requeued = requeued + 1
  else
    redis.call('RPUSH', KEYS[4], id)
    requeued = requeued + 1
  end
end
return {requeued, dead}
"""

# KEYS: tasks leases owners attempts errors dead dead_counts; ARGV: id replica code message maxlen.
# Only the replica holding the lease may give the task up.
_DEAD_LETTER = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return 0 end
local task = redis.call('HGET', KEYS[1], ARGV[1]) or ''
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[5], '*', 'task_id', ARGV[1], 'code', ARGV[3],
  'reason', ARGV[3] .. ': ' .. ARGV[4], 'task', task, 'replica', ARGV[2])
redis.call('HINCRBY', KEYS[7], ARGV[3], 1)
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
return 1
"""


# Two pools of replicas share one queue: `rollouts` (every replica by default: training rollouts
# and μ's evals) and `policy_eval` (replicas that serve the trainer's weights unquantised: π's
# evals). A task's pool follows from its id, so submitting and re-queueing route it alike.
POOLS = {"rollouts": "pending", "policy_eval": "pending_policy"}
POLICY_EVAL_PREFIX = "evalpi"

# KEYS: leases; ARGV: prefix. {leased task ids without the prefix, with it}: each pool's leases,
# counted in one step so the two always add up to the leases.
_LEASED_BY_POOL = """
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local n = 0
for _, id in ipairs(ids) do
  if string.sub(id, 1, #ARGV[1]) == ARGV[1] then n = n + 1 end
end
return {#ids - n, n}
"""


def pool_of(task_id: str) -> str:
    """The pool that serves a task: `policy_eval` for ids starting with POLICY_EVAL_PREFIX."""
    return "policy_eval" if task_id.startswith(POLICY_EVAL_PREFIX) else "rollouts"


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Lease:
    task_id: str
    task: common_pb2.PromptTask
    attempt: int


@dataclass(frozen=True)
class QueueDepths:
    pending: int  # the rollouts pool's
    leased: int  # the rollouts pool's
    completed: int
    dead: int
    rollouts: int
    pending_policy: int = 0  # the policy_eval pool's
    leased_policy: int = 0  # the policy_eval pool's


class WorkQueue(RolloutSink):
    """One run's work queue and rollout stream on a Redis server (redis.asyncio client); `pool`:
    whose pending tasks `lease` takes (`POOLS`)."""

    def __init__(self, redis: Redis, run_id: str, dead_maxlen: int = 10_000, pool: str = "rollouts") -> None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {sorted(POOLS)}, got {pool!r}")
        self.redis, self.run_id, self.dead_maxlen, self.pool = redis, run_id, dead_maxlen, pool
        self.run_keys = RunKeys(run_id)
        self._submit = redis.register_script(_SUBMIT)
        self._lease = redis.register_script(_LEASE)
        self._extend = redis.register_script(_EXTEND)
        self._complete = redis.register_script(_COMPLETE)
        self._fail = redis.register_script(_FAIL)
        self._requeue = redis.register_script(_REQUEUE)
        self._dead_letter = redis.register_script(_DEAD_LETTER)
        self._leased_by_pool = redis.register_script(_LEASED_BY_POOL)

    @property
    def keys(self) -> dict[str, str]:
        """Every key of the run by name (`shared.keys`)."""
        return self.run_keys.all()

    def _k(self, *names: str) -> list[str]:
        return [getattr(self.run_keys, n) for n in names]

    @property
    def rollout_stream(self) -> str:
        return self.run_keys.rollouts

    async def submit(self, task: common_pb2.PromptTask) -> bool:
        """Queue a task; False when a task with its id is already queued or leased."""
        return (await self.submit_many([task]))[0]

    async def submit_many(self, tasks: list[common_pb2.PromptTask],
                          record: tuple[str, dict[str, int | str]] | None = None) -> list[bool]:
        """Queue tasks in one MULTI; per task: queued, or False when its id is already queued.

        `record` = (hash key, fields) is written in the same transaction: a producer's cursor
        moves exactly when its tasks are queued, so a crash never resubmits or skips one."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for task in tasks:
                if not task.task_id:
                    raise ValueError("a task needs a task_id")
                if not task.enqueued_unix_ms:
                    task.enqueued_unix_ms = now_ms()
                pending = POOLS[pool_of(task.task_id)]
                await self._submit(self._k("tasks", pending), [task.task_id, task.SerializeToString()], client=pipe)
            if record is not None:
                pipe.hset(record[0], mapping=record[1])
            results = await pipe.execute()
        return [bool(x) for x in results[: len(tasks)]]

    async def lease(self, replica_id: str, lease_seconds: float, count: int = 1) -> list[Lease]:
        """Up to `count` tasks of this queue's pool, each leased to `replica_id` for `lease_seconds`.
        A task whose bytes are not a PromptTask goes to the dead-letter stream (code `decode`) instead."""
        flat = await self._lease(
            self._k(POOLS[self.pool], "leases", "owners", "tasks", "attempts"),
            [now_ms(), int(lease_seconds * 1000), replica_id, count],
        )
        out = []
        for i in range(0, len(flat), 3):
            task_id = flat[i].decode(errors="replace")
            try:
                task = common_pb2.PromptTask.FromString(flat[i + 1])
            except (DecodeError, RuntimeError, ValueError) as exc:
                await self.dead_letter(replica_id, task_id, "decode", f"not a steadyrl.v1.PromptTask: {exc}")
                continue
            task.attempt = int(flat[i + 2])
            out.append(Lease(task_id, task, task.attempt))
        return out

    async def extend(self, replica_id: str, task_ids: list[str], lease_seconds: float) -> int:
        """Push the deadlines of leases this replica still holds; returns how many it holds."""
        if not task_ids:
            return 0
        return int(await self._extend(self._k("leases", "owners"),
                                      [now_ms(), int(lease_seconds * 1000), replica_id, *task_ids]))

    async def complete(self, replica_id: str, task_id: str, rollouts: list[bytes]) -> bool:
        """Publish a task's rollouts and end its lease, atomically; False when the lease was lost."""
        return (await self.complete_many(replica_id, [(task_id, rollouts)]))[0]

    async def complete_many(self, replica_id: str, done: list[tuple[str, list[bytes]]],
                            evals: set[str] = frozenset()) -> list[bool]:
        """`complete` for several tasks in one round trip (each task atomically on its own);
        the rollouts of tasks in `evals` go to the `evals` stream."""
        if not done:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id, rollouts in done:
                stream = "evals" if task_id in evals else "rollouts"
                keys = self._k("leases", "owners", "tasks", "attempts", "completed", stream, "errors")
                await self._complete(keys, [task_id, replica_id, *rollouts], client=pipe)
            return [int(x) >= 0 for x in await pipe.execute()]

    async def completed_count(self) -> int:
        return int(await self.redis.hlen(self.run_keys.completed))

    async def lease_stamps(self, task_ids: list[str]) -> dict[str, str | None]:
        """The lease (`replica|attempt`) that completed each task, None where none did."""
        if not task_ids:
            return {}
        values = await self.redis.hmget(self.run_keys.completed, task_ids)
        return {t: (v.decode() if v is not None else None) for t, v in zip(task_ids, values, strict=True)}

    async def fail(self, replica_id: str, task_id: str, reason: str = "") -> bool:
        """Give a task back (engine error, shutdown): it is retried, and the attempt counts. The
        reason is kept, and named if the task runs out of attempts."""
        return bool(await self._fail(self._k("leases", "owners", "errors"), [task_id, replica_id, reason[:500]]))

    async def dead_letter(self, replica_id: str, task_id: str, code: str, message: str) -> bool:
        """Give up a task this replica holds that can never be served: to `dead` with the reason."""
        keys = self._k("tasks", "leases", "owners", "attempts", "errors", "dead", "dead_counts")
        return bool(await self._dead_letter(keys, [task_id, replica_id, code, message[:1000], self.dead_maxlen]))

    async def requeue_expired(self, max_attempts: int) -> tuple[int, int]:
        """Re-queue tasks whose lease expired; past `max_attempts` they go to `dead`. (requeued, dead)"""
        keys = self._k("leases", "owners", "attempts", "pending", "tasks", "dead", "errors", "dead_counts",
                       "pending_policy")
        requeued, dead = await self._requeue(keys, [now_ms(), max_attempts, self.dead_maxlen, POLICY_EVAL_PREFIX])
        return int(requeued), int(dead)

    async def dead_counts(self) -> dict[str, int]:
        """Dead-lettered tasks by reason code, since the run began."""
        return {k.decode(): int(v) for k, v in (await self.redis.hgetall(self.run_keys.dead_counts)).items()}

    async def pending_count(self) -> int:
        """Tasks waiting for this queue's pool (one LLEN: a replica's lag, without `depths`' scan
        of the leases)."""
        return int(await self.redis.llen(getattr(self.run_keys, POOLS[self.pool])))

    async def depths(self) -> QueueDepths:
        """Every queue's length; pending and leased tasks per pool (`leased` is the rollouts
        pool's alone, so a scaler on it does not count π's eval tasks)."""
        k = self.run_keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.llen(k.pending).hlen(k.completed).xlen(k.dead).xlen(k.rollouts).llen(k.pending_policy)
            await self._leased_by_pool([k.leases], [POLICY_EVAL_PREFIX], client=pipe)
            pending, completed, dead, rollouts, pending_policy, (leased, leased_policy) = await pipe.execute()
        return QueueDepths(int(pending), int(leased), int(completed), int(dead), int(rollouts), int(pending_policy),
                           int(leased_policy))
