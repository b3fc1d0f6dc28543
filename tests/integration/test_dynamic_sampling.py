"""Dynamic sampling in the trainer's intake, against a real redis-server: a complete group with equal
rewards is acknowledged into `trained:filtered` (never trained, never lost), at most the cap per step,
and a copy that comes back is a duplicate; past the cap the group stays to be trained."""

import asyncio
import dataclasses

import numpy as np
from redis.asyncio import Redis

from services.trainer.checkpoint import TrainerState
from services.trainer.groups import GroupBuffer
from services.trainer.intake import Intake
from services.trainer.stream import RedisRolloutSource
from shared.rollouts.record import Rollout, RolloutLimits, encode_rollout
from shared.runstore.keys import RunKeys
from shared.runstore.ledger import Ledger
from tests.unit.test_group_buffer import rollout as group_rollout

G = 2


def rollout(run_id: str, task: str, index: int, reward: float) -> Rollout:
    """The group buffer tests' rollout, in groups of G, of this run, with this reward, sampled by version 0 (the
    trainer's own: a later version would be dead-lettered as from the future)."""
    versions = np.zeros(2, dtype=np.uint64)
    return dataclasses.replace(
        group_rollout(task, index), run_id=run_id, group_size=G, reward=reward, policy_versions=versions
    )


async def publish(redis: Redis, keys: RunKeys, rollouts: list[Rollout]) -> None:
    for r in rollouts:
        await redis.hset(keys.completed, r.task_id, "replica-0|1")
        fields = {"task": r.task_id, "lease": "replica-0|1", "n": str(G), "r": encode_rollout(r)}
        await redis.xadd(keys.rollouts, fields)


def test_equal_reward_groups_are_filtered_up_to_the_cap(redis_server, run_id):
    rewards = {"t0": (1.0, 1.0), "t1": (0.0, 1.0), "t2": (0.0, 0.0), "t3": (1.0, 1.0), "t4": (0.5, 0.5)}

    async def scenario():
        redis = Redis.from_url(redis_server.url)
        keys = RunKeys(run_id)
        source = RedisRolloutSource(redis, run_id, "c0")
        await source.open()
        state = TrainerState()
        buffer = GroupBuffer(G, run_id, RolloutLimits(vocab_size=16, max_total_tokens=64))
        intake = Intake(source, buffer, state)
        await publish(
            redis, keys, [rollout(run_id, t, i, r) for t, pair in rewards.items() for i, r in enumerate(pair)]
        )
        await intake.take(await source.read(100))
        assert buffer.complete() == ["t0", "t1", "t2", "t3", "t4"]
        await intake.filter_equal(cap=2)  # t0 and t2 filtered; t3 and t4 over the cap: kept, to be trained
        assert buffer.complete() == ["t1", "t3", "t4"] and intake.filtered_this_step == 2
        assert state.counters == {"filtered_groups": 2, "filter_cap_hit": 2}
        await intake.filter_equal(cap=2)  # each group is examined once: nothing changes
        assert buffer.complete() == ["t1", "t3", "t4"] and state.counters["filter_cap_hit"] == 2
        ledger = Ledger(redis, run_id)
        assert await ledger.filtered() == ["t0:0", "t0:1", "t2:0", "t2:1"]
        counts = await ledger.counts()
        assert (counts.trained, counts.dropped, counts.filtered) == (0, 0, 4)
        assert await ledger.settled_groups(["t0", "t1", "t2"]) == {"t0", "t2"}
        assert await redis.xlen(keys.rollouts) == 6  # the filtered entries acknowledged and deleted
        # a step takes two groups: a new allowance; the kept t4 was examined, so it is trained later
        buffer.take(["t1", "t3"])
        intake.next_step()
        assert intake.filtered_this_step == 0 and intake.examined == {"t4"}
        # a filtered rollout delivered again (Redis lost the acknowledgement, the task ran again): a duplicate
        again = rollout(run_id, "t2", 0, 0.0)
        await publish(redis, keys, [again])
        await intake.take(await source.read(100))
        assert state.counters["duplicates"] == 1 and "t2" not in buffer.groups
        # Redis lost the ledger (a host crash): the reconcile writes the filtered ids back
        await redis.delete(keys.filtered, keys.trained_ids)
        await intake.reconcile(set())
        assert await ledger.filtered() == ["t0:0", "t0:1", "t2:0", "t2:1"]
        await redis.aclose()

    asyncio.run(scenario())
