"""Multi-turn tasks served by a whole replica (real redis-server, weight-sync and gRPC, the torch
engine, the kit's calc model): each of a task's G trajectories is one rollout — the model's turns
and the environment's answers interleaved, the loss mask marking the model's tokens, whose
logprobs and routing equal a fresh forward; an environment that raises, hangs, answers malformed,
floods the budget, is unknown or cannot be made dead-letters its task with the reason, counted,
and the replica serves the next task."""

import asyncio

import numpy as np
import torch
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from shared.models import load_causal_lm, load_tokenizer
from shared.rollouts.record import decode_rollout, validate_rollout
from shared.rpc.steadyrl.v1 import common_pb2
from shared.runstore.queues import WorkQueue
from tests.helpers import submit
from tests.integration.test_inference import Replica, _completed, fresh_forward, wait_for


def multiturn_task(
    task_id: str, environment: str, group_size: int = 2, answer: str = "408", max_tokens: int = 40
) -> common_pb2.PromptTask:
    return common_pb2.PromptTask(
        task_id=task_id,
        prompt_text="12*34=",
        answer=answer,
        group_size=group_size,
        environment=environment,
        budget=common_pb2.TrajectoryBudget(max_turns=4, max_tokens=max_tokens, env_seconds=1.0),
        sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=6, seed=3),
    )


def failures(reason: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "steadyrl_inference_trajectory_failures_total", {"replica": "replica-a", "reason": reason}
        )
        or 0.0
    )


BAD = {
    "raises": ("tests.envs:Raises", "env_error"),
    "hangs": ("tests.envs:Hangs", "env_timeout"),
    "malformed": ("tests.envs:Malformed", "malformed_observation"),
    "floods": ("tests.envs:Floods", "over_budget"),
    "unmade": ("tests.envs:not_an_environment", "env_error"),
    "unknown": ("nope", "environment"),
}


def test_a_replica_plays_multi_turn_tasks_and_dead_letters_bad_environments(
    tmp_path, calc_model_dir, redis_server, run_id
):
    before = {code: failures(code) for _, code in BAD.values()}
    tasks = [
        multiturn_task("echo", "tests.envs:Echo"),
        multiturn_task("calc", "calc", group_size=4),
        *(multiturn_task(name, env) for name, (env, _) in BAD.items()),
        multiturn_task("after", "tests.envs:Echo"),
    ]

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        declared = sorted({t.environment for t in tasks if ":" in t.environment})  # as the recipe would name them
        async with Replica(
            tmp_path, calc_model_dir, redis_server.url, run_id, tasks={"per_batch": 1}, plugins=declared
        ) as replica:
            for task in tasks:
                await submit(queue, task)
            await wait_for(lambda: _completed(queue, 3), 120)
            await wait_for(lambda: _dead(queue, len(BAD)), 60)
            alive = (await replica.stub.Status(common_pb2.Empty())).replica_id
            entries = await redis.xrange(queue.rollout_stream)
            dead = {f[b"task_id"].decode(): f for _, f in await redis.xrange(queue.run_keys.dead)}
        await redis.aclose()
        return alive, entries, dead

    alive, entries, dead = asyncio.run(asyncio.wait_for(main(), 240))
    assert alive == "replica-a"
    rollouts = {r.rollout_id: r for r in (decode_rollout(f[b"r"]) for _, f in entries)}
    assert sorted(rollouts) == ["after:0", "after:1", "calc:0", "calc:1", "calc:2", "calc:3", "echo:0", "echo:1"]
    tokenizer = load_tokenizer(str(calc_model_dir))
    observation = tokenizer.encode("=42:", add_special_tokens=False)
    model = load_causal_lm(calc_model_dir, "float32")
    worst = 0.0
    for r in rollouts.values():
        validate_rollout(r)
        assert (
            r.prompt_token_ids.tolist()
            == tokenizer.apply_chat_template(
                [{"role": "user", "content": "12*34="}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        mask = r.model_tokens
        logp, trace = fresh_forward(model, r.prompt_token_ids.tolist(), r.completion_token_ids.tolist())
        worst = max(worst, float((logp - torch.from_numpy(r.inference_logprobs))[torch.from_numpy(mask)].abs().max()))
        np.testing.assert_array_equal(r.routing_trace, trace)  # composed turn by turn, equal to one forward
        assert not r.inference_logprobs[~mask].any() and set(r.policy_versions.tolist()) == {0}
        if r.task_id in ("echo", "after"):  # three model turns, two observations in between
            assert (r.turns, r.reward, r.finish_reason, r.env_metrics) == (
                3,
                1.0,
                "done",
                {"tool_calls": 2.0, "answered": 1.0},
            )
            runs = np.flatnonzero(np.diff(mask.astype(int)))  # where the mask switches
            assert len(runs) == 4 and mask[0] and mask[-1]
            for start, end in ((runs[0] + 1, runs[1] + 1), (runs[2] + 1, runs[3] + 1)):
                assert r.completion_token_ids[start:end].tolist()[-len(observation) :] == observation
        else:  # the calc environment: calls and their answers, then an answer (or out of turns)
            assert r.reward in (0.0, 1.0) and r.finish_reason in ("done", "max_turns", "max_tokens")
            assert r.turns == r.env_metrics.get("tool_calls", 0) + (r.finish_reason == "done")
    assert worst <= 1e-5
    assert {name: dead[name][b"code"].decode() for name in BAD} == {name: code for name, (_, code) in BAD.items()}
    assert b"an environment bug" in dead["raises"][b"reason"] and b"over 1 s" in dead["hangs"][b"reason"]
    for code in ("env_error", "env_timeout", "malformed_observation", "over_budget"):
        expected = sum(c == code for name, (_, c) in BAD.items())
        assert failures(code) == before[code] + expected, code


async def _dead(queue: WorkQueue, count: int) -> bool:
    return sum((await queue.dead_counts()).values()) >= count
