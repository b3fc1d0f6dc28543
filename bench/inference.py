"""Inference benchmark: rollout tokens/s of a whole replica (Redis queue → engine → scored
rollouts on the stream) against the bare engine on the same prompts, and the torch engine
against the vllm engine, all in one run. Prints one JSON object.

The replica is a real `python -m services.inference` process on a real redis-server; the bare
engines run the same batches (tasks_per_batch tasks × G samples) with the same sampling. The torch
engine has one intra-op thread in both, as in configs/tiny-arith.toml (the tiny model gains
nothing from a second one, and the replica's own work and Redis get the other core). Bare and
replica rounds alternate; the machine's speed drifts within a run, so the ratio is the median of
each replica round over the bare round just before it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# 512 tasks: a round of a few seconds, so the fixed latencies of a round (the replica's idle poll
# before its first lease, this process's completion poll) are not counted as service overhead
TASKS, GROUP, TASKS_PER_BATCH, MAX_NEW_TOKENS = 512, 8, 8, 8
TORCH_THREADS = 1


def workload():
    from shared.models.tiny import TinySpec, char_tokenizer, encode_prompts

    examples = TinySpec().task(seed=1).split("train", TASKS)
    return examples, encode_prompts(char_tokenizer(), [e.prompt for e in examples])


class Bare:
    """An engine driven directly, with the replica's batching (tasks_per_batch tasks × G)."""

    def __init__(self, name: str, model_dir: str, dtype: str) -> None:
        from shared.engines import Sampling, make_engine

        self.engine = make_engine(name, model_dir, dtype,
                                  **({"max_model_len": 64} if name == "vllm" else {"threads": TORCH_THREADS}))
        self.prompts = workload()[1]
        self.sampling = Sampling(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=1)
        self.traces = self.engine.capabilities.routing_trace  # as the replica does: traces when available
        self.engine.generate(self.prompts[:2], self.sampling)  # warm-up

    def round(self) -> tuple[int, float]:
        tokens, started = 0, time.perf_counter()
        for start in range(0, TASKS, TASKS_PER_BATCH):
            batch = [p for p in self.prompts[start : start + TASKS_PER_BATCH] for _ in range(GROUP)]
            tokens += sum(len(s.token_ids) for s in self.engine.generate(batch, self.sampling, self.traces))
        return tokens, time.perf_counter() - started


def summary(rounds: list[tuple[int, float]]) -> dict:
    """Median round: tokens, seconds, tokens/s (and every round's tokens/s)."""
    rates = sorted(tokens / seconds for tokens, seconds in rounds)
    return {"tokens_per_round": rounds[0][0], "rounds": len(rounds), "tokens_per_s": round(rates[len(rates) // 2], 1),
            "tokens_per_s_each": [round(r, 1) for r in rates]}


def paired_ratios(service: list[tuple[int, float]], bare: list[tuple[int, float]]) -> list[float]:
    """tokens/s of each replica round over that of the bare round just before it, sorted."""
    return sorted(round((st / ss) / (bt / bs), 3) for (st, ss), (bt, bs) in zip(service, bare, strict=True))


async def service_and_bare(model_dir: str, dtype: str, redis_url: str,
                           rounds: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Alternate rounds: the bare engine, then the replica on the same prompts, `rounds` times;
    (tokens, seconds) of each round of each."""
    from redis.asyncio import Redis

    from shared.queues import WorkQueue
    from shared.redis_server import free_port
    from shared.rollout import decode_rollout
    from shared.rpc.auth import channel as auth_channel
    from shared.rpc.steadyrl.v1 import common_pb2, inference_pb2_grpc

    bare = Bare("torch", model_dir, dtype)
    port = free_port()
    env = {**os.environ, "STEADYRL_INFERENCE_MODEL_PATH": model_dir, "STEADYRL_INFERENCE_DTYPE": dtype,
           "STEADYRL_INFERENCE_REDIS_URL": redis_url, "STEADYRL_INFERENCE_RUN_ID": "bench",
           "STEADYRL_INFERENCE_PORT": str(port), "STEADYRL_INFERENCE_METRICS_PORT": "0",
           "STEADYRL_INFERENCE_TASKS_PER_BATCH": str(TASKS_PER_BATCH), "STEADYRL_INFERENCE_RETURN_ROUTING_TRACES": "1",
           "STEADYRL_INFERENCE_TORCH_THREADS": str(TORCH_THREADS),
           "STEADYRL_LOG_LEVEL": "WARNING"}
    replica = subprocess.Popen([sys.executable, "-m", "services.inference"], env=env)
    redis = Redis.from_url(redis_url)
    try:
        async with auth_channel(f"127.0.0.1:{port}") as channel:
            await inference_pb2_grpc.InferenceStub(channel).Status(common_pb2.Empty(), wait_for_ready=True, timeout=120)
        queue = WorkQueue(redis, "bench")
        examples, prompts = workload()
        sampling = common_pb2.SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=1)

        def task(task_id: str, index: int) -> common_pb2.PromptTask:
            return common_pb2.PromptTask(task_id=task_id, run_id="bench", task_name="exact_match",
                                         prompt_token_ids=prompts[index], answer=examples[index].answer,
                                         group_size=GROUP, sampling=sampling)

        async def completed_at_least(count: int) -> None:
            while await queue.completed_count() < count:
                await asyncio.sleep(0.01)

        await queue.submit(task("warmup", 0))  # the bare engine is timed warm too
        await completed_at_least(1)
        bare_rounds, service_rounds, done = [], [], 1
        for round_ in range(rounds):
            bare_rounds.append(bare.round())
            await redis.delete(queue.rollout_stream)
            started = time.perf_counter()
            await queue.submit_many([task(f"r{round_}-{i}", i) for i in range(TASKS)])
            done += TASKS
            await completed_at_least(done)
            seconds = time.perf_counter() - started
            entries = await redis.xrange(queue.rollout_stream)
            assert len(entries) == TASKS * GROUP
            service_rounds.append((sum(len(decode_rollout(f[b"r"]).completion_token_ids) for _, f in entries), seconds))
        return bare_rounds, service_rounds
    finally:
        await redis.aclose()
        replica.terminate()
        replica.wait(30)
        bare.engine.close()


def vllm_in_subprocess(model_dir: str, dtype: str, rounds: int) -> dict:
    """vLLM spawns workers: it runs in a process of its own, under a __main__ guard."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vllm is not installed"}
    done = subprocess.run([sys.executable, "-m", "bench.inference", "--bare", "vllm", model_dir, dtype, str(rounds)],
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-2000:]}


def main(dtype: str = "bfloat16", rounds: int = 7) -> dict:
    from shared.models.tiny import init_tiny_model
    from shared.redis_server import RedisServer

    model_dir = str(init_tiny_model())
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as redis:
        bare_rounds, service_rounds = asyncio.run(service_and_bare(model_dir, dtype, redis.url, rounds))
    torch_bare, replica, paired = summary(bare_rounds), summary(service_rounds), paired_ratios(service_rounds, bare_rounds)
    vllm_bare = vllm_in_subprocess(model_dir, dtype, rounds)
    result = {
        "benchmark": "inference", "model": "tiny-qwen3-moe", "dtype": dtype, "tasks": TASKS, "group_size": GROUP,
        "tasks_per_batch": TASKS_PER_BATCH, "max_new_tokens": MAX_NEW_TOKENS, "torch_threads": TORCH_THREADS,
        "torch_bare": torch_bare, "torch_service": replica,
        "service_to_bare_ratio": paired[len(paired) // 2], "service_to_bare_ratio_each_round": paired,
        "ratio_of_median_rates": round(replica["tokens_per_s"] / torch_bare["tokens_per_s"], 3),
        "target_service_to_bare_ratio": 0.9,
        "vllm_bare": vllm_bare,
    }
    if "tokens_per_s" in vllm_bare:
        result["vllm_to_torch_ratio"] = round(vllm_bare["tokens_per_s"] / torch_bare["tokens_per_s"], 3)
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bare"]:
        name, model_dir, dtype, rounds = sys.argv[2:6]
        engine = Bare(name, model_dir, dtype)
        print(json.dumps(summary([engine.round() for _ in range(int(rounds))])))
        engine.engine.close()
    else:
        print(json.dumps(main(*sys.argv[1:2])))
