"""Poison pills in a live run: malformed groups, other runs' and eval rollouts, stray entries in
the rollout stream; garbage, far-future, zero-group, too-long and foreign-eval tasks in the work queue.
Each goes to a dead-letter stream with its reason (or is refused and counted); the trainer and
every replica keep stepping, and the run finishes with every task accounted for."""

import asyncio
from pathlib import Path

import numpy as np
import pytest
from redis.asyncio import Redis

from shared.rollouts.record import Rollout, encode_rollout
from shared.rpc.steadyrl.v1 import common_pb2
from shared.runstore.keys import RunKeys
from steadyrl.recipe import load_recipe
from tests.chaos.test_faults import read_ledger
from tests.helpers import running, wait_until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
B = 4
G = 8
RUN = "tiny-arith"


def rollout(task: str, index: int, group_size: int = G, run_id: str = RUN, is_eval: bool = False) -> bytes:
    return encode_rollout(
        Rollout(
            rollout_id=f"{task}:{index}",
            group_id=task,
            task_id=task,
            run_id=run_id,
            sample_index=index,
            group_size=group_size,
            prompt_token_ids=np.array([1, 5, 6], dtype=np.int32),
            completion_token_ids=np.array([7, 2], dtype=np.int32),
            inference_logprobs=np.array([-0.5, -0.1], np.float32),
            policy_versions=np.array([1, 1], dtype=np.uint64),
            reward=1.0,
            is_eval=is_eval,
        )
    )


async def publish_as(redis, keys: RunKeys, task: str, payloads: list[bytes], lease: str | None = "rogue|0") -> None:
    """What a misbehaving replica's completion leaves in Redis (or, without a lease, a stray entry)."""
    if lease is not None:
        await redis.hset(keys.completed, task, lease)
    for data in payloads:
        fields = {"task": task, "n": str(len(payloads)), "r": data}
        if lease is not None:
            fields["lease"] = lease
        await redis.xadd(keys.rollouts, fields)


async def inject(url: str, marker: Path) -> None:
    redis = Redis.from_url(url)
    keys = RunKeys(RUN)
    # the rollout stream
    await publish_as(redis, keys, "evil-incomplete", [rollout("evil-incomplete", i) for i in range(5)])
    await publish_as(redis, keys, "evil-overfull", [rollout("evil-overfull", i) for i in range(G + 1)])
    await publish_as(redis, keys, "evil-missized", [rollout("evil-missized", i, group_size=4) for i in range(4)])
    await publish_as(redis, keys, "train-100000", [rollout("train-100000", i) for i in range(G)], lease=None)
    await redis.xadd(keys.rollouts, {"task": "x", "lease": "rogue|0", "n": "8", "r": rollout("x", 0, run_id="other")})
    await publish_as(redis, keys, "evil-eval", [rollout("evil-eval", i, is_eval=True) for i in range(G)])
    # the work queue
    good = common_pb2.PromptTask(
        run_id=RUN,
        task_name="exact_match",
        prompt_token_ids=[1, 5, 6],
        answer="1",
        group_size=2,
        sampling=common_pb2.SamplingParams(max_new_tokens=4),
    )
    bad_tasks = {
        "garbage-task": b"\xff\xfe not a protobuf \x00\x01",
        "far-future": _with(good, task_id="far-future", min_policy_version=10**9).SerializeToString(),
        "zero-group": _with(good, task_id="zero-group", group_size=0).SerializeToString(),
        "too-long": _with(
            good, task_id="too-long", sampling=common_pb2.SamplingParams(max_new_tokens=100_000)
        ).SerializeToString(),
        "eval-x-y": _with(good, task_id="eval-x-y", is_eval=True, group_size=1).SerializeToString(),
        "overlong-buffer": _with(  # a shaping buffer as long as the budget
            good, task_id="overlong-buffer", overlong=common_pb2.OverlongShaping(buffer_tokens=4, penalty=1.0)
        ).SerializeToString(),
        # plug-ins the run never named: pydoc.pipepager(completion, answer) would run the answer in a shell
        "forged-reward": _with(
            good, task_id="forged-reward", task_name="pydoc:pipepager", answer=f"touch {marker}-reward"
        ).SerializeToString(),
        "forged-agent": _with(
            good, task_id="forged-agent", environment=f"agent:touch {marker}-agent", prompt_text="1+1="
        ).SerializeToString(),
    }
    for task_id, data in bad_tasks.items():
        await redis.hset(keys.tasks, task_id, data)
        await redis.lpush(keys.pending, task_id)
    await redis.aclose()


def _with(task: common_pb2.PromptTask, **fields) -> common_pb2.PromptTask:
    copy = common_pb2.PromptTask()
    copy.CopyFrom(task)
    for name, value in fields.items():
        if isinstance(value, common_pb2.SamplingParams | common_pb2.OverlongShaping):  # message fields: copied into
            getattr(copy, name).CopyFrom(value)
        else:
            setattr(copy, name, value)
    return copy


async def dead_letters(url: str) -> tuple[dict, dict, set[str], list[str]]:
    redis = Redis.from_url(url)
    keys = RunKeys(RUN)
    rollouts = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.rollouts_dead_counts)).items()}
    tasks = {k.decode(): int(v) for k, v in (await redis.hgetall(keys.dead_counts)).items()}
    groups = {g.decode() for g in await redis.smembers(keys.trained_dead)}
    reasons = [f[b"reason"].decode() for _, f in await redis.xrange(keys.dead)]
    await redis.aclose()
    return rollouts, tasks, groups, reasons


def test_poison_pills_are_dead_lettered_and_the_run_goes_on(tmp_path, tiny_model_dir):
    config = load_recipe(
        ROOT / "configs" / "tiny-arith.toml",
        [
            f"run.steps={STEPS}",
            f"run.batch_prompts={B}",
            f"run.group_size={G}",
            "run.replicas=2",
            "orchestrator.evals.every=0",
            "inference.tasks.lease_seconds=30",  # renewed every 10 s: a loaded CI box stalls a replica for seconds
            "inference.tasks.per_batch=2",
            "inference.tasks.version_wait_seconds=1",
            "orchestrator.max_attempts=2",
        ],
    )
    with running(config, tmp_path, tiny_model_dir) as launch:
        asyncio.run(inject(launch.redis.url, tmp_path / "forged"))
        # finished, and the far-future task ran out of attempts too
        wait_until(
            launch, lambda status: status["state"] == "finished" and status["dead_letters"]["tasks"].get("attempts")
        )
        # the trainer exits after publishing its last step, which "finished" may precede by seconds
        next(s for s in launch.services if s.name == "trainer").process.wait(60)
        alive = {s.name: s.process.poll() is None for s in launch.services}
        trained, dropped, dead, submitted, _ = asyncio.run(read_ledger(launch.redis.url, RUN))
        rollouts_dead, tasks_dead, dead_groups, task_reasons = asyncio.run(dead_letters(launch.redis.url))
    assert alive == {
        "weightsync": True,
        "trainer": False,
        "inference-0": True,
        "inference-1": True,
        "orchestrator": True,
    }  # the trainer finished its steps; nothing else stopped
    assert rollouts_dead == {
        "publication_size": 2,  # the incomplete group (5 of 8) and the over-full one (9 of 8), first members
        "group_poisoned": 4 + 7 + 3,  # the rest of those groups and of the mis-sized one
        "group": 1,  # the over-full group's sample index 8
        "group_size": 1,  # a group of 4 where the run trains groups of 8 (its first member)
        "no_lease": G,  # entries nobody's lease published (a real task id pre-empted: refused)
        "other_run": 1,
        "eval_rollout": G,
    }
    assert dead_groups == {"evil-incomplete", "evil-overfull", "evil-missized"}
    assert tasks_dead == {"decode": 1, "group_size": 1, "context": 1, "attempts": 1, "overlong": 1, "undeclared": 2}
    assert any("'pydoc:pipepager' is no reward or environment this run declares" in r for r in task_reasons)
    assert not list(tmp_path.glob("forged-*"))  # neither was imported nor run
    assert any("max_new_tokens (100000) > the engine's" in r for r in task_reasons)  # refused, not crashed
    assert any("version_wait" in r and "1000000000" in r for r in task_reasons)  # the reason names the wait
    assert "event=eval_rollout_refused" in (tmp_path / "logs" / "orchestrator.log").read_text()
    assert len(trained) == len(set(trained)) == STEPS * B * G
    accounted = {rid.split(":")[0] for rid in trained} | {rid.split(":")[0] for rid in dropped} | dead
    assert accounted >= {f"train-{i}" for i in range(submitted)}
    assert all(
        t.startswith("train-")
        or t
        in {"garbage-task", "far-future", "zero-group", "too-long", "overlong-buffer", "forged-reward", "forged-agent"}
        for t in accounted
    )
