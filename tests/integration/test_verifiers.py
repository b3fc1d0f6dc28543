"""A `verifiers` environment plays a replica's tasks (real replica, real Redis, the torch engine, the
kit's calc model, verifiers' own rollout loop and rubric; tests/vf_calc.py): each trajectory's calls
reach the replica's OpenAI endpoint through verifiers' OpenAI client, are recorded under their
rollout — the model's tokens with logprobs equal to a fresh forward, the environment's tool
messages masked out — and the rubric's reward and metrics are the rollout's. An environment that
cannot be loaded, raises or hangs dead-letters its task with the reason; the replica serves on."""

import asyncio
import json

import torch
from redis.asyncio import Redis

from shared.envs import verifiers_adapter
from shared.models import load_causal_lm, load_tokenizer
from shared.rollouts.record import decode_rollout, validate_rollout
from shared.rpc.steadyrl.v1 import common_pb2
from shared.runstore.queues import WorkQueue
from tests.helpers import submit
from tests.integration.test_inference import Replica, _completed, fresh_forward, wait_for
from tests.integration.test_multiturn_replica import _dead

ENV = "verifiers:tests.vf_calc"


def vf_task(
    task_id: str, environment: str = ENV, row: int = 0, group_size: int = 4, temperature: float = 1.0
) -> common_pb2.PromptTask:
    rows = verifiers_adapter.examples(ENV, "train", 8)
    return common_pb2.PromptTask(
        task_id=task_id,
        prompt_text=rows[row].prompt,
        answer=rows[row].answer,
        task_name="exact_match",
        group_size=group_size,
        environment=environment,
        sampling=common_pb2.SamplingParams(temperature=temperature, max_new_tokens=14, seed=3),
        budget=common_pb2.TrajectoryBudget(max_turns=3, max_tokens=42, env_seconds=30.0 if environment == ENV else 3.0),
    )


def test_the_adapter_parses_names_and_reads_the_environments_rows():
    assert verifiers_adapter.parse('verifiers:tests.vf_calc {"size": 5}') == ("tests.vf_calc", {"size": 5})
    for bad in ("verifiers:", "verifiers:x {nope", "verifiers:x [1]", "calc"):
        try:
            verifiers_adapter.parse(bad)
            raise AssertionError(bad)
        except ValueError as exc:
            assert "verifiers" in str(exc) or "JSON" in str(exc)
    rows = verifiers_adapter.examples('verifiers:tests.vf_calc {"size": 5}', "train", 100)
    assert [e.answer for e in rows] == [str(12 * 13), str(12 * 24), str(12 * 35), str(12 * 46), str(12 * 57)]
    assert json.loads(rows[1].prompt)["prompt"] == [{"role": "user", "content": "12*24="}]
    assert [m.content for m in verifiers_adapter.prompt_messages(rows[1].prompt)] == ["12*24="]
    try:
        verifiers_adapter.load("verifiers:tests.no_such_env")
        raise AssertionError("loaded")
    except ValueError as exc:
        assert "could not be loaded" in str(exc)


def test_a_verifiers_environment_plays_trained_rollouts_through_the_replica(
    tmp_path, calc_model_dir, redis_server, run_id
):
    tasks = [
        vf_task("vf-0", row=0),
        vf_task("vf-1", row=1),
        vf_task("missing", "verifiers:tests.no_such_env", 0, 1),
        # greedy: the calc model then calls its tool, whatever the sampler's draws, so the broken env is reached
        vf_task("raises", 'verifiers:tests.vf_calc {"mode": "raise"}', 2, 2, temperature=0.0),
        vf_task("hangs", 'verifiers:tests.vf_calc {"mode": "hang"}', 3, 2, temperature=0.0),
    ]

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        declared = sorted({t.environment for t in tasks if ":" in t.environment})  # as the recipe would name them
        async with Replica(
            tmp_path, calc_model_dir, redis_server.url, run_id, agent={"endpoint": True}, plugins=declared
        ) as replica:
            for task in tasks:
                await submit(queue, task)
            await wait_for(lambda: _completed(queue, 2), 120)
            await wait_for(lambda: _dead(queue, 3), 60)
            alive = (await replica.stub.Status(common_pb2.Empty())).replica_id
            entries = await redis.xrange(queue.rollout_stream)
            dead = {f[b"task_id"].decode(): f for _, f in await redis.xrange(queue.run_keys.dead)}
        await redis.aclose()
        return alive, entries, dead

    alive, entries, dead = asyncio.run(asyncio.wait_for(main(), 240))
    assert alive == "replica-a"
    rollouts = [decode_rollout(f[b"r"]) for _, f in entries]
    assert sorted(r.rollout_id for r in rollouts) == [f"vf-{t}:{i}" for t in range(2) for i in range(4)]
    tokenizer = load_tokenizer(str(calc_model_dir))
    model = load_causal_lm(calc_model_dir, "float32")
    answers = {"vf-0": str(12 * 13), "vf-1": str(12 * 24)}
    worst = 0.0
    tool_used = 0
    for r in rollouts:
        validate_rollout(r)
        mask = r.model_tokens
        assert r.turns == r.env_metrics["model_calls"] >= 1 and r.finish_reason == "done"
        assert r.env_metrics["num_turns"] == r.turns and r.env_metrics["correct"] == r.reward
        logp, _ = fresh_forward(model, r.prompt_token_ids.tolist(), r.completion_token_ids.tolist())
        worst = max(worst, float((logp - torch.from_numpy(r.inference_logprobs))[torch.from_numpy(mask)].abs().max()))
        text = tokenizer.decode(r.completion_token_ids.tolist(), skip_special_tokens=False)
        if r.turns > 1:  # verifiers ran the tool and sent its answer back: in the record, masked out
            tool_used += 1
            assert "= " in text and not mask.all()
        final = text.split(":")[-1].replace("</s>", "").strip()
        assert r.reward == (1.0 if final == answers[r.task_id] else 0.0), text
    assert worst <= 1e-5 and tool_used >= 1
    assert {t: dead[t][b"code"].decode() for t in ("missing", "raises", "hangs")} == {
        "missing": "environment",
        "raises": "env_error",
        "hangs": "env_timeout",
    }
    assert b"could not be loaded" in dead["missing"][b"reason"] and b"the tool is broken" in dead["raises"][b"reason"]
