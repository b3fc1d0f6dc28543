"""Rollout transport benchmark: steadyrl's path (encode → XADD → XREADGROUP → decode + validate) against a
raw XADD → XREADGROUP of the same bytes, on one real redis-server in the same run. Prints one JSON object.

Two shapes: the tiny demo's rollouts, and a Qwen3-30B-A3B-like math rollout (256 prompt + 2,048
completion tokens, 48 MoE layers, top-8 of 128 experts: a 0.88 MB routing trace each).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np

SHAPES = {
    "tiny": {"prompt": 8, "completion": 6, "layers": 2, "top_k": 2, "experts": 8, "rollouts": 4096},
    "moe_30b_a3b": {"prompt": 256, "completion": 2048, "layers": 48, "top_k": 8, "experts": 128, "rollouts": 256},
}
GROUP = 8
STREAM = "bench:rollouts"
CONSUMER_GROUP = "bench"


def make_rollouts(shape: dict, seed: int = 0):
    from shared.rollouts.record import Rollout

    rng = np.random.default_rng(seed)
    p = shape["prompt"]
    c = shape["completion"]
    layers = shape["layers"]
    k = shape["top_k"]
    experts = shape["experts"]
    out = []
    for i in range(shape["rollouts"]):
        base = rng.integers(0, experts, size=(p + c - 1, layers, 1))
        trace = ((base + np.arange(k)) % experts).astype(np.uint8)  # k distinct experts per position and layer
        out.append(
            Rollout(
                rollout_id=f"t{i // GROUP}:{i % GROUP}",
                group_id=f"t{i // GROUP}",
                task_id=f"t{i // GROUP}",
                prompt_token_ids=rng.integers(0, 32000, p).astype(np.int32),
                completion_token_ids=rng.integers(0, 32000, c).astype(np.int32),
                inference_logprobs=-rng.random(c, dtype=np.float32),
                policy_versions=np.full(c, 7, np.uint64),
                reward=1.0,
                sample_index=i % GROUP,
                group_size=GROUP,
                run_id="bench",
                routing_trace=trace,
                num_experts=experts,
                replica_id="replica-0",
                engine="torch",
            )
        )
    return out


async def _through(redis, payloads_of, count: int, consume) -> float:
    """XADD `count` entries (pipelined a group at a time), then read them all back; seconds."""
    await redis.delete(STREAM)
    await redis.xgroup_create(STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    started = time.perf_counter()
    for start in range(0, count, GROUP):
        async with redis.pipeline(transaction=True) as pipe:  # a replica publishes a task's G rollouts at once
            for data in payloads_of(start, min(start + GROUP, count)):
                pipe.xadd(STREAM, {"r": data})
            await pipe.execute()
    seen = 0
    while seen < count:
        reply = await redis.xreadgroup(CONSUMER_GROUP, "trainer", {STREAM: ">"}, count=512)
        entries = reply[0][1]
        for _, fields in entries:
            consume(fields[b"r"])
        seen += len(entries)
    return time.perf_counter() - started


async def measure(redis_url: str, name: str, shape: dict, rounds: int) -> dict:
    from redis.asyncio import Redis

    from shared.rollouts.record import RolloutLimits, decode_rollout, encode_rollout, validate_rollout

    rollouts = make_rollouts(shape)
    encoded = [encode_rollout(r) for r in rollouts]
    limits = RolloutLimits(
        vocab_size=32000, num_layers=shape["layers"], top_k=shape["top_k"], num_experts=shape["experts"], max_version=7
    )
    count = len(rollouts)
    total = sum(len(b) for b in encoded)

    def steadyrl_payloads(a, b):
        return [encode_rollout(r) for r in rollouts[a:b]]

    def steadyrl_consume(data):
        validate_rollout(decode_rollout(data, limits), limits)

    redis = Redis.from_url(redis_url)
    raw = []
    full = []
    try:
        for _ in range(rounds):  # alternate, so both see the same machine
            raw.append(await _through(redis, lambda a, b: encoded[a:b], count, lambda data: None))
            full.append(await _through(redis, steadyrl_payloads, count, steadyrl_consume))
        await redis.delete(STREAM)
    finally:
        await redis.aclose()
    raw_s = statistics.median(raw)
    full_s = statistics.median(full)
    return {
        "shape": name,
        "rollouts": count,
        "bytes_per_rollout": total // count,
        "raw_mb_per_s": round(total / raw_s / 1e6, 1),
        "steadyrl_mb_per_s": round(total / full_s / 1e6, 1),
        "steadyrl_rollouts_per_s": round(count / full_s, 1),
        "ratio_steadyrl_to_raw": round(raw_s / full_s, 3),
        "rounds": rounds,
    }


def main(rounds: int = 3) -> dict:
    import tempfile
    from pathlib import Path

    from shared.runstore.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as server:
        shapes = [asyncio.run(measure(server.url, name, shape, rounds)) for name, shape in SHAPES.items()]
    return {
        "benchmark": "transport",
        "group_size": GROUP,
        "shapes": shapes,
        "target": "ratio_steadyrl_to_raw: the codec's cost on top of Redis itself",
    }


if __name__ == "__main__":
    import json

    print(json.dumps(main()))
