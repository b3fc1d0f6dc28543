"""Multi-turn rollouts against single-turn ones of the same total tokens, in one run. Prints one JSON object.

Workload: the kit's calc model on the torch engine (bf16), a real Redis and the real replica, `TASKS` tasks × G in
two shapes (`SHAPES`). A multi-turn task is fixed-length model turns answered by a fixed observation (`Fixed`); a
single-turn task asks for as many tokens in one completion. Rounds alternate single, multi; ratios are medians of
each multi round over the single round before it. Beside them: the engine driven directly.

Details: docs/internals/bench.md"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from shared.envs.base import Environment, Message, Step

TASKS = 192
GROUP = 4
MAX_INFLIGHT = 16
ROUNDS = 5
SHAPES = ((3, 8), (2, 16))  # (model turns, tokens per turn): within the tiny model's 64 positions
PROMPT = "12*34="


class Fixed(Environment):
    """Answers every turn with `=1234` (reward 0): the turn budget ends the trajectory."""

    def reset(self, task):
        return [Message("user", task["prompt"])]

    def step(self, model_turn):
        return Step([Message("tool", "=1234")], 0.0, False)


def shapes(tokenizer, turns: int, turn_tokens: int) -> tuple[list[int], int]:
    """The rendered prompt, and the completion tokens of one trajectory (model + environment)."""
    from shared.envs.trajectory import render

    prompt = render(tokenizer, [], [Message("user", PROMPT)])
    turn = [tokenizer.pad_token_id] * turn_tokens  # what a turn samples does not change what follows it
    observation = render(
        tokenizer,
        [Message("user", PROMPT), Message("assistant", tokenizer.decode(turn))],
        [Message("tool", "=1234")],
        turn,
    )
    return prompt, turns * (turn_tokens + len(observation))


def tasks(kind: str, tag: str, prompt: list[int], total: int, turns: int, turn_tokens: int) -> list:
    from bench.inference import RUN_ID
    from shared.rpc.steadyrl.v1 import common_pb2

    out = []
    for i in range(TASKS):
        common = {"task_id": f"{tag}-{i}", "run_id": RUN_ID, "answer": "0", "group_size": GROUP}
        if kind == "multi":
            out.append(
                common_pb2.PromptTask(
                    **common,
                    prompt_text=PROMPT,
                    environment="bench.multiturn:Fixed",
                    budget=common_pb2.TrajectoryBudget(max_turns=turns, max_tokens=total, env_seconds=10),
                    sampling=common_pb2.SamplingParams(
                        temperature=1.0, max_new_tokens=turn_tokens, seed=1, ignore_eos=True
                    ),
                )
            )
        else:
            out.append(
                common_pb2.PromptTask(
                    **common,
                    task_name="exact_match",
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=total, seed=1, ignore_eos=True),
                )
            )
    return out


async def replica_round(queue, redis, replica, batch) -> tuple[int, int, float]:
    """(completion tokens, model tokens, seconds) of one round through the replica."""
    from shared.rollouts.record import decode_rollout

    await redis.delete(queue.rollout_stream)
    done = await queue.completed_count()
    async with replica:
        started = time.time()
        await queue.submit_many(batch)
        while await queue.completed_count() < done + len(batch):
            await asyncio.sleep(0.1)
    entries = await redis.xrange(queue.rollout_stream)
    assert len(entries) == len(batch) * GROUP, len(entries)
    rollouts = [decode_rollout(f[b"r"]) for _, f in entries]
    last_ms = max(int(entry_id.split(b"-")[0]) for entry_id, _ in entries)
    return (
        sum(len(r.completion_token_ids) for r in rollouts),
        sum(int(r.model_tokens.sum()) for r in rollouts),
        last_ms / 1000 - started,
    )


async def bare_round(engine, prompt: list[int], total: int) -> tuple[int, float]:
    from shared.engines import Sampling

    gate, sampling = (
        asyncio.Semaphore(MAX_INFLIGHT),
        Sampling(temperature=1.0, max_new_tokens=total, seed=1, ignore_eos=True),
    )

    async def task() -> int:
        async with gate:
            futures = [asyncio.wrap_future(engine.start(prompt, sampling, True, index=k)) for k in range(GROUP)]
            return sum(len(s.token_ids) for s in await asyncio.gather(*futures))

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(task() for _ in range(TASKS))))
    return tokens, time.perf_counter() - started


async def shape_bench(engine, model_dir: str, redis_url: str, turns: int, turn_tokens: int) -> dict:
    from redis.asyncio import Redis

    from bench.inference import RUN_ID, Replica
    from shared.models import load_tokenizer
    from shared.runstore.queues import WorkQueue

    prompt, total = shapes(load_tokenizer(model_dir), turns, turn_tokens)
    redis = Redis.from_url(redis_url)
    queue = WorkQueue(redis, RUN_ID)
    try:
        await bare_round(engine, prompt, total)  # warm-up
        bare = []
        single = []
        multi = []
        for r in range(ROUNDS):
            tag = f"{turns}x{turn_tokens}-{r}"
            bare.append(await bare_round(engine, prompt, total))
            single.append(
                await replica_round(
                    queue,
                    redis,
                    Replica(engine, model_dir, "bfloat16", redis_url, "continuous"),
                    tasks("single", f"s{tag}", prompt, total, turns, turn_tokens),
                )
            )
            multi.append(
                await replica_round(
                    queue,
                    redis,
                    Replica(engine, model_dir, "bfloat16", redis_url, "continuous"),
                    tasks("multi", f"m{tag}", prompt, total, turns, turn_tokens),
                )
            )
    finally:
        await redis.aclose()
    per_s = [(s[0] / s[2], m[0] / m[2], m[1] / m[2], b[0] / b[1]) for s, m, b in zip(single, multi, bare, strict=True)]
    # the same tokens, but where a turn's last sampled token is the one the template closes a turn
    # with (end of sequence, which `ignore_eos` lets the model sample): it is not added again
    assert all(s[0] == TASKS * GROUP * total >= m[0] >= 0.9 * s[0] for s, m in zip(single, multi, strict=True)), (
        single,
        multi,
        total,
    )
    return {
        "turns": turns,
        "turn_tokens": turn_tokens,
        "completion_tokens_per_rollout": total,
        "model_tokens_per_trajectory": turns * turn_tokens,
        "prompt_tokens": len(prompt),
        "tokens_per_round": {"single": single[0][0], "multi": multi[0][0]},
        "bare_engine_tokens_per_s": round(statistics.median(p[3] for p in per_s), 1),
        "single_turn_tokens_per_s": round(statistics.median(p[0] for p in per_s), 1),
        "multi_turn_tokens_per_s": round(statistics.median(p[1] for p in per_s), 1),
        "multi_turn_model_tokens_per_s": round(statistics.median(p[2] for p in per_s), 1),
        "multi_over_single": round(statistics.median(p[1] / p[0] for p in per_s), 3),
        "multi_over_single_each_round": [round(p[1] / p[0], 3) for p in per_s],
        "single_over_bare_engine": round(statistics.median(p[0] / p[3] for p in per_s), 3),
    }


def main() -> dict:
    from shared.engines import make_engine
    from shared.kit.tiny import init_tiny_model
    from shared.runstore.redis_server import RedisServer

    model_dir = str(init_tiny_model(task="calc"))
    result = {
        "benchmark": "multiturn",
        "model": "tiny-qwen3-moe (calc kit)",
        "engine": "torch",
        "dtype": "bfloat16",
        "tasks": TASKS,
        "group_size": GROUP,
        "max_inflight_tasks": MAX_INFLIGHT,
        "rounds": ROUNDS,
        "targets": {"multi_over_single": 0.8},
    }
    engine = make_engine("torch", model_dir, "bfloat16", threads=1, max_num_seqs=256)
    try:
        with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as redis:
            result["torch"] = {
                f"{turns}x{tokens}": asyncio.run(shape_bench(engine, model_dir, redis.url, turns, tokens))
                for turns, tokens in SHAPES
            }
    finally:
        engine.close()
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
