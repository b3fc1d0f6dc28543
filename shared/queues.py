"""The Redis work queue of prompt tasks (with leases) and the rollout stream.

Keys, all under `steadyrl:{run_id}:`

- `tasks`     HASH  task_id → PromptTask (protobuf bytes) while the task is not done
- `pending`   LIST  task_ids waiting for a replica (LPUSH new, RPOP next; a retry goes first)
- `leases`    ZSET  task_id → lease deadline (unix ms)
- `owners`    HASH  task_id → replica holding the lease
- `attempts`  HASH  task_id → leases that expired or failed so far
- `completed` HASH  task_id → replica whose rollouts were published
- `dead`      STREAM task_id, reason, task: tasks given up after too many attempts
- `rollouts`  STREAM one entry per rollout: task (task_id), r (Rollout protobuf bytes)
- `evals`     STREAM the same for evaluation tasks (is_eval): never trained on

Every state change is one Lua script, so a replica that dies at any point leaves the task either
pending, leased (its lease expires, `requeue_expired` puts it back) or completed — never half.
`complete` publishes all G rollouts of a task and ends its lease in one step, and only while the
caller still owns the lease: a replica whose lease was taken away publishes nothing, so each task
reaches the stream exactly once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

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

# KEYS: leases owners tasks attempts completed rollouts; ARGV: id replica r1 ... rN
_COMPLETE = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return -1 end
for i = 3, #ARGV do
  redis.call('XADD', KEYS[6], '*', 'task', ARGV[1], 'r', ARGV[i])
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HSET', KEYS[5], ARGV[1], ARGV[2])
return #ARGV - 2
"""

# KEYS: leases owners; ARGV: id replica. Ends the lease now; the next sweep counts the attempt.
_FAIL = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[1], 0, ARGV[1])
return 1
"""

# KEYS: leases owners attempts pending tasks dead; ARGV: now_ms max_attempts
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
    redis.call('XADD', KEYS[6], '*', 'task_id', id, 'reason',
      'lease expired or failed ' .. attempts .. ' times (last replica ' .. owner .. ')', 'task', task)
    redis.call('HDEL', KEYS[5], id)
    redis.call('HDEL', KEYS[3], id)
    dead = dead + 1
  else
    redis.call('RPUSH', KEYS[4], id)
    requeued = requeued + 1
  end
end
return {requeued, dead}
"""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Lease:
    task_id: str
    task: common_pb2.PromptTask
    attempt: int


@dataclass(frozen=True)
class QueueDepths:
    pending: int
    leased: int
    completed: int
    dead: int
    rollouts: int


class WorkQueue:
    """One run's work queue and rollout stream on a Redis server (redis.asyncio client)."""

    def __init__(self, redis: Redis, run_id: str) -> None:
        if not run_id or any(c in run_id for c in "{}: "):
            raise ValueError(f"run_id {run_id!r} must be non-empty without braces, colons or spaces")
        self.redis, self.run_id = redis, run_id
        prefix = f"steadyrl:{run_id}:"
        names = ("tasks", "pending", "leases", "owners", "attempts", "completed", "dead", "rollouts", "evals")
        self.keys = {name: prefix + name for name in names}
        self._submit = redis.register_script(_SUBMIT)
        self._lease = redis.register_script(_LEASE)
        self._extend = redis.register_script(_EXTEND)
        self._complete = redis.register_script(_COMPLETE)
        self._fail = redis.register_script(_FAIL)
        self._requeue = redis.register_script(_REQUEUE)

    def _k(self, *names: str) -> list[str]:
        return [self.keys[n] for n in names]

    @property
    def rollout_stream(self) -> str:
        return self.keys["rollouts"]

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
                await self._submit(self._k("tasks", "pending"), [task.task_id, task.SerializeToString()], client=pipe)
            if record is not None:
                pipe.hset(record[0], mapping=record[1])
            results = await pipe.execute()
        return [bool(x) for x in results[: len(tasks)]]

    async def lease(self, replica_id: str, lease_seconds: float, count: int = 1) -> list[Lease]:
        flat = await self._lease(
            self._k("pending", "leases", "owners", "tasks", "attempts"),
            [now_ms(), int(lease_seconds * 1000), replica_id, count],
        )
        out = []
        for i in range(0, len(flat), 3):
            task = common_pb2.PromptTask.FromString(flat[i + 1])
            task.attempt = int(flat[i + 2])
            out.append(Lease(flat[i].decode(), task, task.attempt))
        return out

    async def extend(self, replica_id: str, task_ids: list[str], lease_seconds: float) -> int:
        """Push the deadlines of leases this replica still holds; returns how many it holds."""
        if not task_ids:
            return 0
        return int(await self._extend(self._k("leases", "owners"), [now_ms(), int(lease_seconds * 1000), replica_id, *task_ids]))

    async def complete(self, replica_id: str, task_id: str, rollouts: list[bytes]) -> bool:
        """Publish a task's rollouts and end its lease, atomically; False when the lease was lost."""
        return (await self.complete_many(replica_id, [(task_id, rollouts)]))[0]

    async def complete_many(self, replica_id: str, done: list[tuple[str, list[bytes]]],
                            evals: set[str] = frozenset()) -> list[bool]:
        """`complete` for several tasks in one round trip (each task atomically on its own);
        the rollouts of tasks in `evals` go to the `evals` stream."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id, rollouts in done:
                stream = "evals" if task_id in evals else "rollouts"
                keys = self._k("leases", "owners", "tasks", "attempts", "completed", stream)
                await self._complete(keys, [task_id, replica_id, *rollouts], client=pipe)
            return [int(x) >= 0 for x in await pipe.execute()]

    async def completed_count(self) -> int:
        return int(await self.redis.hlen(self.keys["completed"]))

    async def fail(self, replica_id: str, task_id: str) -> bool:
        """Give a task back (engine error, shutdown): it is retried, and the attempt counts."""
        return bool(await self._fail(self._k("leases", "owners"), [task_id, replica_id]))

    async def requeue_expired(self, max_attempts: int) -> tuple[int, int]:
        """Re-queue tasks whose lease expired; past `max_attempts` they go to `dead`. (requeued, dead)"""
        keys = self._k("leases", "owners", "attempts", "pending", "tasks", "dead")
        requeued, dead = await self._requeue(keys, [now_ms(), max_attempts])
        return int(requeued), int(dead)

    async def depths(self) -> QueueDepths:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.llen(self.keys["pending"]).zcard(self.keys["leases"]).hlen(self.keys["completed"])
            pipe.xlen(self.keys["dead"]).xlen(self.keys["rollouts"])
            return QueueDepths(*(int(x) for x in await pipe.execute()))
