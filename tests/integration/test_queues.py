"""The Redis work queue on a real redis-server: leases, expiry, retries, dead letters, atomic
completion."""

import asyncio

import pytest
from redis.asyncio import Redis

from shared.rpc.steadyrl.v1 import common_pb2
from shared.runstore.queues import WorkQueue
from tests.helpers import submit


def task(task_id: str, group_size: int = 2) -> common_pb2.PromptTask:
    return common_pb2.PromptTask(
        task_id=task_id, task_name="exact_match", prompt_token_ids=[1, 5, 6], answer="11", group_size=group_size
    )


def run(redis_server, run_id, body):
    async def main():
        redis = Redis.from_url(redis_server.url)
        try:
            await body(WorkQueue(redis, run_id), redis)
        finally:
            await redis.aclose()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_fifo_leases_and_duplicate_submits(redis_server, run_id):
    async def body(queue, redis):
        assert await submit(queue, task("a")) and await submit(queue, task("b"))
        assert not await submit(queue, task("a"))  # already queued: not twice
        leases = await queue.lease("r1", 30, count=5)
        assert [lease.task_id for lease in leases] == ["a", "b"]
        assert leases[0].task.answer == "11" and leases[0].attempt == 0
        assert await queue.lease("r2", 30) == []
        depths = await queue.depths()
        assert (depths.pending, depths.leased, depths.completed) == (0, 2, 0)

    run(redis_server, run_id, body)


def test_a_lost_lease_cannot_publish_and_the_new_owner_publishes_once(redis_server, run_id):
    async def body(queue, redis):
        await submit(queue, task("a"))
        [first] = await queue.lease("r1", 0.05)
        await asyncio.sleep(0.1)
        assert await queue.requeue_expired(max_attempts=3) == (1, 0)
        [second] = await queue.lease("r2", 30)
        assert second.task_id == "a" and second.attempt == 1
        assert await queue.extend("r1", ["a"], 30) == 0  # r1 no longer holds it
        assert not await queue.complete("r1", "a", [b"x1", b"x2"])  # late, refused
        assert await queue.complete("r2", "a", [b"y1", b"y2"])
        assert not await queue.complete("r2", "a", [b"y1", b"y2"])  # once only
        entries = await redis.xrange(queue.rollout_stream)
        assert [e[1][b"r"] for e in entries] == [b"y1", b"y2"]
        assert all(e[1][b"task"] == b"a" for e in entries)
        depths = await queue.depths()
        assert (depths.pending, depths.leased, depths.completed, depths.rollouts) == (0, 0, 1, 2)

    run(redis_server, run_id, body)


def test_renewed_leases_survive_and_failures_go_to_dead_letters(redis_server, run_id):
    async def body(queue, redis):
        await submit(queue, task("kept"))
        await submit(queue, task("bad"))
        leases = {lease.task_id: lease for lease in await queue.lease("r1", 0.3, count=2)}
        await asyncio.sleep(0.15)
        assert await queue.extend("r1", ["kept"], 30) == 1
        assert await queue.fail("r1", "bad")
        await asyncio.sleep(0.2)
        assert await queue.requeue_expired(max_attempts=2) == (1, 0)  # "bad" only: "kept" was renewed
        for attempt in (1, 2):
            [lease] = await queue.lease("r1", 30)
            assert (lease.task_id, lease.attempt) == ("bad", attempt)
            await queue.fail("r1", "bad")
            assert await queue.requeue_expired(max_attempts=2) == ((1, 0) if attempt == 1 else (0, 1))
        [(_, fields)] = await redis.xrange(queue.keys["dead"])
        assert fields[b"task_id"] == b"bad" and b"3 times" in fields[b"reason"]
        assert common_pb2.PromptTask.FromString(fields[b"task"]).answer == "11"
        assert "kept" in leases and await queue.complete("r1", "kept", [b"k"])
        depths = await queue.depths()
        assert (depths.pending, depths.leased, depths.completed, depths.dead) == (0, 0, 1, 1)

    run(redis_server, run_id, body)


def test_a_pending_id_without_its_task_is_dead_lettered_with_the_reason(redis_server, run_id):
    """An id in `pending` whose record is gone is never dropped silently: `no_record`, or
    `duplicate` when that task was completed already (which is not counted as a task given up)."""
    from shared.runstore.queues import given_up

    async def body(queue, redis):
        await submit(queue, task("done"))
        [lease] = await queue.lease("r1", 30)
        assert await queue.complete("r1", "done", [b"r"])
        await redis.lpush(queue.keys["pending"], "done", "ghost", "real")  # leased in this order
        await redis.hset(queue.keys["tasks"], "real", task("real").SerializeToString())
        leases = await queue.lease("r2", 30, count=5)
        assert [lease.task_id for lease in leases] == ["real"]
        entries = [fields for _, fields in await redis.xrange(queue.keys["dead"])]
        assert [(f[b"task_id"], f[b"code"]) for f in entries] == [(b"done", b"duplicate"), (b"ghost", b"no_record")]
        assert (entries[0][b"code"], entries[0][b"reason"]) == (
            b"duplicate",
            b"pending again after the lease r1|0 completed it",
        )
        assert (entries[1][b"code"], entries[1][b"reason"]) == (
            b"no_record",
            b"a pending task id without a task record",
        )
        assert [given_up(f) for f in entries] == [False, True]
        assert await queue.dead_counts() == {"no_record": 1, "duplicate": 1}
        assert (await queue.depths()).pending == 0

    run(redis_server, run_id, body)


def test_a_lease_whose_reply_was_lost_is_reclaimed_not_left_to_expire(redis_server, run_id):
    async def body(queue, redis):
        for name in ("held", "lost", "other"):
            await submit(queue, task(name))
        [held] = await queue.lease("r1", 30)
        await queue.lease("r1", 30)  # Redis ran it, the reply never came back: r1 does not know it holds "lost"
        await queue.lease("r2", 30)
        deadline_before = await redis.zscore(queue.keys["leases"], "lost")
        await asyncio.sleep(0.01)
        reclaimed = await queue.reclaim("r1", {"held"}, 60)
        assert [(lease.task_id, lease.attempt, lease.task.answer) for lease in reclaimed] == [("lost", 0, "11")]
        assert await redis.zscore(queue.keys["leases"], "lost") > deadline_before + 29_000  # a fresh deadline
        assert await queue.reclaim("r1", {"held", "lost"}, 60) == []
        assert held.task_id == "held" and await queue.complete("r1", "lost", [b"x"])

    run(redis_server, run_id, body)


def test_policy_eval_tasks_stay_in_their_pool_through_expiry(redis_server, run_id):
    """π's eval tasks (ids starting `evalpi`) are queued in the policy_eval pool's list, leased only
    by a policy_eval queue, counted in that pool's depths, and an expired lease puts them back
    there, not in the rollouts pool."""

    async def body(queue, redis):
        policy = WorkQueue(redis, run_id, pool="policy_eval")
        await queue.submit_many([task("train-0"), task("evalpi-0-0", 1), task("eval-0-0", 1)])
        depths = await queue.depths()
        assert (depths.pending, depths.pending_policy, depths.pending_eval) == (2, 1, 1)  # μ's eval-0-0 counted apart
        [leased] = await policy.lease("p", 0.05, count=5)
        assert leased.task_id == "evalpi-0-0"
        depths = await queue.depths()  # a scaler on the rollouts pool's pending + leased does not see π's task
        assert (depths.pending, depths.leased, depths.pending_policy, depths.leased_policy) == (2, 0, 0, 1)
        assert (await queue.pending_count(), await policy.pending_count()) == (2, 0)  # each replica's lag
        await asyncio.sleep(0.1)
        assert await queue.requeue_expired(max_attempts=3) == (1, 0)
        assert [t.decode() for t in await redis.lrange(queue.keys["pending_policy"], 0, -1)] == ["evalpi-0-0"]
        assert sorted(lease.task_id for lease in await queue.lease("r", 30, count=5)) == ["eval-0-0", "train-0"]
        [again] = await policy.lease("p", 30)
        depths = await queue.depths()
        assert (depths.pending, depths.leased, depths.pending_policy, depths.leased_policy) == (0, 2, 0, 1)
        assert (depths.pending_eval, depths.leased_eval) == (0, 1)  # training work: leased - leased_eval = 1
        assert (again.task_id, again.attempt) == ("evalpi-0-0", 1)
        assert await policy.complete_many("p", [("evalpi-0-0", [b"pi"])], {"evalpi-0-0"}) == [True]
        assert [e[1][b"r"] for e in await redis.xrange(queue.keys["evals"])] == [b"pi"]

    run(redis_server, run_id, body)


def test_a_queue_names_its_pool(redis_server, run_id):
    with pytest.raises(ValueError, match="pool must be one of"):
        WorkQueue(Redis.from_url(redis_server.url), run_id, pool="evals")


def test_redis_server_in_a_relative_directory(tmp_path, monkeypatch):
    from pathlib import Path

    import redis

    from shared.runstore.redis_server import RedisServer

    monkeypatch.chdir(tmp_path)
    with RedisServer(Path("runs") / "r" / "redis") as server:  # `steadyrl run --out runs/...` is relative
        assert redis.Redis.from_url(server.url).ping()
        assert server.directory == tmp_path / "runs" / "r" / "redis" and (server.directory / "redis.log").exists()


def test_a_redis_password_with_url_characters_works_escaped_in_the_url_or_from_a_file(tmp_path):
    """A password holding @ / : # ? % either URL-escaped in redis_url or, as deployments mount it, in
    redis_password_file beside a URL without one (nothing to escape); a wrong one is refused."""
    import redis.exceptions

    from services.orchestrator.config import OrchestratorSettings
    from shared.runstore.redis_server import RedisServer

    password = "p@ss/w:rd#?%&"
    server = RedisServer(tmp_path / "redis", password=password).start()
    try:
        (tmp_path / "password").write_text(password + "\n")
        (tmp_path / "wrong").write_text("nope")
        bare = f"redis://127.0.0.1:{server.port}/0"

        async def ping(**fields) -> bool:
            client = OrchestratorSettings(model_path="m", **fields).redis()
            try:
                return await client.ping()
            finally:
                await client.aclose()

        assert "%40" in server.url and asyncio.run(ping(redis_url=server.url))
        assert asyncio.run(ping(redis_url=bare, redis_password_file=tmp_path / "password"))
        with pytest.raises(redis.exceptions.AuthenticationError):
            asyncio.run(ping(redis_url=bare, redis_password_file=tmp_path / "wrong"))
    finally:
        server.stop()


class CountingQueue(WorkQueue):
    """The real queue, counting the Redis calls that complete tasks and the tasks each carried."""

    calls: list[int]

    async def complete_many(self, replica_id, done, evals=frozenset()):
        self.calls.append(len(done))
        return await super().complete_many(replica_id, done, evals)


def test_a_burst_of_finishing_tasks_is_sent_in_one_call_and_a_stuck_one_never_holds_the_rest(redis_server, run_id):
    from services.inference.finishing import SETTLE_SECONDS, Finishing
    from services.inference.rollout_sender import RolloutSender

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = CountingQueue(redis, run_id)
        queue.calls = []
        for i in range(5):
            await submit(queue, task(f"t{i}"))
        leases = await queue.lease("r1", 30, count=5)
        finishing = Finishing()

        async def requeue(task_id: str, reason: str) -> None:
            raise AssertionError(f"{task_id} requeued: {reason}")

        sender = RolloutSender(queue, "r1", {lease.task_id for lease in leases}, requeue, finishing.settled)
        sending = asyncio.create_task(sender.loop())
        for lease in leases[:3]:  # three groups leave the engine together, then are scored one by one
            finishing.begin(lease.task_id)
        for lease in leases[:3]:
            await asyncio.sleep(0.002)  # a group's scoring and encoding
            sender.add(lease, [b"a", b"b"])
            finishing.end(lease.task_id)
        await asyncio.sleep(0.05)
        assert queue.calls == [3]  # one Redis call for the burst, not one a task
        finishing.begin(leases[3].task_id)  # one stuck in its scoring ...
        sender.add(leases[4], [b"c", b"d"])  # ... holds the next send back at most SETTLE_SECONDS
        started = asyncio.get_running_loop().time()
        while len(queue.calls) < 2:
            await asyncio.sleep(0.001)
        waited = asyncio.get_running_loop().time() - started
        sending.cancel()
        entries = await redis.xrange(queue.rollout_stream)
        await redis.aclose()
        return queue.calls, waited, [e[1][b"task"] for e in entries]

    calls, waited, tasks = asyncio.run(asyncio.wait_for(main(), 30))
    assert calls == [3, 1] and SETTLE_SECONDS * 0.9 <= waited <= 1.0
    assert tasks == [b"t0", b"t0", b"t1", b"t1", b"t2", b"t2", b"t4", b"t4"]  # each once, nothing lost
