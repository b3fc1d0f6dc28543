"""Agent programs drive rollouts through a replica's OpenAI-compatible endpoint (real replica, real
Redis, the torch engine, the kit's calc model): an unmodified program (tests/agent_calc.py: plain
HTTP, its own calculator) plays each trajectory; every call is recorded under its rollout — the
model's tokens with their logprobs (equal to a fresh forward), the program's messages masked out —
and its printed answer is scored by the task's reward. A program that fails, hangs or never calls
the model dead-letters its task with the reason; bad calls get 4xx; the replica serves on."""

import asyncio
import json
import sys
import urllib.error
import urllib.request

import torch
from redis.asyncio import Redis

from shared.models import load_causal_lm, load_tokenizer
from shared.rollouts.record import decode_rollout, validate_rollout
from shared.rpc.steadyrl.v1 import common_pb2
from shared.runstore.queues import WorkQueue
from tests.helpers import submit
from tests.integration.test_inference import Replica, _completed, fresh_forward, wait_for
from tests.integration.test_multiturn_replica import _dead

AGENT = f"agent:{sys.executable} -m tests.agent_calc"


def agent_task(task_id: str, flags: str = "", group_size: int = 4) -> common_pb2.PromptTask:
    return common_pb2.PromptTask(
        task_id=task_id,
        prompt_text="12*34=",
        answer="408",
        task_name="exact_match",
        group_size=group_size,
        environment=AGENT + flags,
        sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=14, seed=3),
        budget=common_pb2.TrajectoryBudget(max_turns=3, max_tokens=42, env_seconds=20.0 if not flags else 3.0),
    )


def post(url: str, body) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_an_agent_program_drives_trained_rollouts_through_the_openai_endpoint(
    tmp_path, calc_model_dir, redis_server, run_id
):
    tasks = [
        agent_task("agent-0"),
        agent_task("agent-1"),
        agent_task("fails", " --fail", 1),
        agent_task("hangs", " --hang", 1),
        agent_task("silent", " --silent", 1),
    ]

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        declared = sorted({t.environment for t in tasks if ":" in t.environment})  # as the recipe would name them
        async with Replica(
            tmp_path, calc_model_dir, redis_server.url, run_id, agent={"endpoint": True}, plugins=declared
        ) as replica:
            base = replica.parts.endpoint.base_url
            bad = await asyncio.to_thread(
                post, f"{base}/rollouts/nobody/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}]}
            )
            for task in tasks:
                await submit(queue, task)
            await wait_for(lambda: _completed(queue, 2), 120)
            await wait_for(lambda: _dead(queue, 3), 60)
            alive = (await replica.stub.Status(common_pb2.Empty())).replica_id
            entries = await redis.xrange(queue.rollout_stream)
            dead = {f[b"task_id"].decode(): f for _, f in await redis.xrange(queue.run_keys.dead)}
        await redis.aclose()
        return bad, alive, entries, dead

    bad, alive, entries, dead = asyncio.run(asyncio.wait_for(main(), 240))
    assert bad[0] == 404 and bad[1]["error"]["type"] == "not_found" and alive == "replica-a"
    rollouts = [decode_rollout(f[b"r"]) for _, f in entries]
    assert sorted(r.rollout_id for r in rollouts) == [f"agent-{t}:{i}" for t in range(2) for i in range(4)]
    tokenizer = load_tokenizer(str(calc_model_dir))
    model = load_causal_lm(calc_model_dir, "float32")
    worst = 0.0
    tool_used = 0
    for r in rollouts:
        validate_rollout(r)
        mask = r.model_tokens
        assert r.turns == r.env_metrics["model_calls"] >= 1 and r.finish_reason == "done"
        logp, _ = fresh_forward(model, r.prompt_token_ids.tolist(), r.completion_token_ids.tolist())
        worst = max(worst, float((logp - torch.from_numpy(r.inference_logprobs))[torch.from_numpy(mask)].abs().max()))
        turns = tokenizer.decode(r.completion_token_ids.tolist(), skip_special_tokens=False)
        if r.turns > 1:  # the program ran the tool and sent its answer back: in the record, masked out
            tool_used += 1
            assert "= " in turns and not mask.all()
        final = turns.split(":")[-1].replace("</s>", "").strip()
        assert r.reward == (1.0 if final == "408" else 0.0), turns
    assert worst <= 1e-5 and tool_used >= 1
    assert {t: dead[t][b"code"].decode() for t in ("fails", "hangs", "silent")} == {
        "fails": "env_error",
        "hangs": "env_timeout",
        "silent": "env_error",
    }
    assert b"the agent gave up" in dead["fails"][b"reason"] and b"no model call" in dead["silent"][b"reason"]
    assert not any(dead[t][b"reason"].startswith(dead[t][b"code"]) for t in dead)  # the code once, in its own field
