"""The Redis work queue of prompt tasks (with leases) and the rollout stream (`shared.runstore.keys` names every key).

Every state change is one Lua script: a task is pending, leased or completed, never half. `complete` publishes a
task's G rollouts and ends its lease in one step, only while the caller owns the lease, so each task reaches the
stream exactly once; each entry carries its lease (`replica|attempt`). An unservable task goes to the `dead` stream
with a reason code (`dead:counts` counts every code; the stream keeps the newest `dead_maxlen` entries).

Details: docs/internals/orchestrator.md"""

from __future__ import annotations

import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from redis.asyncio import Redis

from shared.rollouts.interfaces import RolloutSink
from shared.rpc.steadyrl.v1 import common_pb2
from shared.runstore import queue_scripts as scripts
from shared.runstore.keys import RunKeys

# Two pools of replicas share one queue: `rollouts` (every replica by default: training rollouts
# and μ's evals) and `policy_eval` (replicas that serve the trainer's weights unquantised: π's
# evals). A task's pool follows from its id, so submitting and re-queueing route it alike.
POOLS = {"rollouts": "pending", "policy_eval": "pending_policy"}
POLICY_EVAL_PREFIX = "evalpi"
EVAL_PREFIX = "eval"  # every eval task's id (μ's in the rollouts pool, π's in its own): not training work

# dead-letter codes that are not a task given up: `duplicate` names a second copy of a completed task's id
NOT_GIVEN_UP = frozenset({"duplicate"})


def given_up(fields: dict[bytes, bytes]) -> bool:
    """Whether an entry of the `dead` stream is a task given up (not a duplicate id of a completed one)."""
    return fields.get(b"code", b"").decode(errors="replace") not in NOT_GIVEN_UP


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
    pending_eval: int = 0  # of the rollouts pool's pending: μ's eval tasks (the rest is training work)
    leased_eval: int = 0  # of the rollouts pool's leased: μ's eval tasks


class WorkQueue(RolloutSink):
    """One run's work queue and rollout stream on a Redis server (redis.asyncio client); `pool`:
    whose pending tasks `lease` takes (`POOLS`)."""

    def __init__(self, redis: Redis, run_id: str, dead_maxlen: int = 10_000, pool: str = "rollouts") -> None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {sorted(POOLS)}, got {pool!r}")
        self.redis = redis
        self.run_id = run_id
        self.dead_maxlen = dead_maxlen
        self.pool = pool
        self.run_keys = RunKeys(run_id)
        self._submit = redis.register_script(scripts.SUBMIT)
        self._lease = redis.register_script(scripts.LEASE)
        self._extend = redis.register_script(scripts.EXTEND)
        self._complete = redis.register_script(scripts.COMPLETE)
        self._fail = redis.register_script(scripts.FAIL)
        self._requeue = redis.register_script(scripts.REQUEUE)
        self._dead_letter = redis.register_script(scripts.DEAD_LETTER)
        self._depths_by_kind = redis.register_script(scripts.DEPTHS_BY_KIND)
        self._reclaim = redis.register_script(scripts.RECLAIM)
        self._unknown = redis.register_script(scripts.UNKNOWN)

    @property
    def keys(self) -> dict[str, str]:
        """Every key of the run by name (`shared.runstore.keys`)."""
        return self.run_keys.all()

    def _k(self, *names: str) -> list[str]:
        return [getattr(self.run_keys, n) for n in names]

    @property
    def rollout_stream(self) -> str:
        return self.run_keys.rollouts

    async def submit_many(
        self, tasks: list[common_pb2.PromptTask], record: tuple[str, dict[str, int | str]] | None = None
    ) -> list[bool]:
        """Queue tasks in one script call; per task: queued, or False when its id is already queued.

        `record` = (hash key, fields) is written in the same step: a producer's cursor moves exactly
        when its tasks are queued, so a crash never resubmits or skips one."""
        args: list[bytes | str | int] = []
        for task in tasks:
            if not task.task_id:
                raise ValueError("a task needs a task_id")
            if not task.enqueued_unix_ms:
                task.enqueued_unix_ms = now_ms()
            args += [task.task_id, task.SerializeToString()]
        fields = [x for pair in (record[1].items() if record else ()) for x in pair]
        keys = self._k("tasks", "pending", "pending_policy") + ([record[0]] if record else [])
        if not tasks and not fields:
            return []
        queued = await self._submit(keys, [POLICY_EVAL_PREFIX, len(fields) // 2, *fields, *args])
        return [bool(x) for x in queued]

    async def lease(self, replica_id: str, lease_seconds: float, count: int = 1) -> list[Lease]:
        """Up to `count` tasks of this queue's pool, each leased to `replica_id` for `lease_seconds`.
        A task whose bytes are not a PromptTask goes to the dead-letter stream (code `decode`)
        instead, a pending id without a task record too (`no_record`, or `duplicate`)."""
        flat = await self._lease(
            self._k(POOLS[self.pool], "leases", "owners", "tasks", "attempts", "completed", "dead", "dead_counts"),
            [now_ms(), int(lease_seconds * 1000), replica_id, count, self.dead_maxlen],
        )
        return await self._leases(replica_id, flat)

    async def reclaim(self, replica_id: str, known: set[str], lease_seconds: float) -> list[Lease]:
        """The tasks Redis says `replica_id` holds that it does not know of (`known`: the leases it
        renews): leased by a call whose reply was lost (it timed out, then Redis ran it). Each gets
        a fresh deadline, so the replica serves it instead of leaving it to expire."""
        flat = await self._reclaim(
            self._k("owners", "tasks", "attempts", "leases"),
            [replica_id, now_ms(), int(lease_seconds * 1000), *sorted(known)],
        )
        return await self._leases(replica_id, flat)

    async def _leases(self, replica_id: str, flat: list[bytes]) -> list[Lease]:
        """(id, task bytes, attempt) triples as leases; undecodable tasks are dead-lettered (`decode`)."""
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
        return int(
            await self._extend(
                self._k("leases", "owners"), [now_ms(), int(lease_seconds * 1000), replica_id, *task_ids]
            )
        )

    async def complete(self, replica_id: str, task_id: str, rollouts: list[bytes]) -> bool:
        """Publish a task's rollouts and end its lease, atomically; False when the lease was lost."""
        return (await self.complete_many(replica_id, [(task_id, rollouts)]))[0]

    async def complete_many(
        self, replica_id: str, done: list[tuple[str, list[bytes]]], evals: set[str] = frozenset()
    ) -> list[bool]:
        """`complete` for several tasks in one script call (each task on its own: one whose lease
        was lost is refused alone); the rollouts of tasks in `evals` go to the `evals` stream."""
        if not done:
            return []
        args: list[bytes | str | int] = [replica_id]
        for task_id, rollouts in done:
            args += [task_id, "e" if task_id in evals else "r", len(rollouts), *rollouts]
        keys = self._k("leases", "owners", "tasks", "attempts", "completed", "rollouts", "evals", "errors")
        return [int(x) >= 0 for x in await self._complete(keys, args)]

    async def unknown(self, prefix: str, first: int, last: int) -> list[str]:
        """The ids `prefix`i (first <= i < last) with neither a task record (queued or leased) nor a
        completed stamp: no replica can ever serve them. A task never passes through such a state;
        only Redis losing writes (a host crash) leaves one there. One script call, whatever the range."""
        if last <= first:
            return []
        found = await self._unknown(self._k("tasks", "completed"), [prefix, first, last])
        return [x.decode() for x in found]

    async def dead_task_ids(self) -> set[str]:
        """The task ids the `dead` stream holds (its newest `dead_maxlen` entries)."""
        entries = await self.redis.xrevrange(self.run_keys.dead, count=self.dead_maxlen)
        return {f.get(b"task_id", b"").decode(errors="replace") for _, f in entries}

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
        keys = self._k(
            "leases", "owners", "attempts", "pending", "tasks", "dead", "errors", "dead_counts", "pending_policy"
        )
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
            await self._depths_by_kind([k.leases, k.pending], [POLICY_EVAL_PREFIX, EVAL_PREFIX], client=pipe)
            pending, completed, dead, rollouts, pending_policy, by_kind = await pipe.execute()
        leased, leased_policy, leased_eval, pending_eval = (int(x) for x in by_kind)
        return QueueDepths(
            int(pending),
            leased,
            int(completed),
            int(dead),
            int(rollouts),
            int(pending_policy),
            leased_policy,
            pending_eval,
            leased_eval,
        )
