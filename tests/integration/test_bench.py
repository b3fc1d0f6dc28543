"""The benchmark code paths run (on small sizes; no timing is asserted) and report what they measured."""

import asyncio

import pytest

from bench.asynchrony import time_to_target
from bench.suite import markdown
from bench.transport import make_rollouts, measure


def test_transport_bench_moves_every_rollout_through_a_real_redis(redis_server):
    shape = {"prompt": 16, "completion": 32, "layers": 4, "top_k": 2, "experts": 16, "rollouts": 24}
    result = asyncio.run(measure(redis_server.url, "small", shape, rounds=1))
    assert result["rollouts"] == 24 and result["rounds"] == 1
    trace_bytes = (16 + 32 - 1) * 4 * 2
    assert trace_bytes < result["bytes_per_rollout"] < trace_bytes + 16 * 5 + 32 * 15 + 200
    assert result["ratio_steadyrl_to_raw"] > 0 and result["steadyrl_mb_per_s"] > 0


def test_transport_rollouts_are_valid():
    from shared.rollout import RolloutLimits, decode_rollout, encode_rollout, validate_rollout

    shape = {"prompt": 5, "completion": 7, "layers": 3, "top_k": 4, "experts": 6, "rollouts": 9}
    limits = RolloutLimits(num_layers=3, top_k=4, num_experts=6, max_version=7)
    for rollout in make_rollouts(shape):
        back = validate_rollout(decode_rollout(encode_rollout(rollout), limits), limits)
        assert back.routing_trace.shape == (11, 3, 4)


def test_weight_bench_times_every_side_on_one_clock():
    """Every transport and both limits on 64 MiB, one round: each side's rate against the one
    raw-socket baseline and memcpy, and the shm figure holding both its halves."""
    from bench.weightsync import BASELINE, measure, report

    nbytes = 64 << 20
    measured = measure(nbytes, rounds=1)
    sides = report(nbytes, measured)
    assert set(sides) == {"memcpy", "raw_socket_1", "raw_socket_2", "grpc_push", "grpc_pull_1", "shm",
                          "collective_1", "collective_2"}
    assert sides[BASELINE]["to_raw_socket"] == 1.0 and sides["memcpy"]["to_memcpy"] == 1.0
    for name, side in sides.items():
        assert side["seconds"] > 0, name
        assert side["to_raw_socket"] == round(measured[BASELINE]["seconds"] / measured[name]["seconds"], 3), name
    shm = sides["shm"]  # the trainer's write + digest, then the replica's map + verify + load, on one clock
    halves = measured["shm"]["trainer_write_digest_seconds"] + measured["shm"]["replica_map_verify_load_seconds"]
    assert halves == pytest.approx(measured["shm"]["seconds"], rel=1e-9) and shm["seconds"] > 0


def test_time_to_target():
    evals = [{"version": 0, "accuracy": 0.4, "unix_ms": 1000}, {"version": 10, "accuracy": 0.58, "unix_ms": 6000},
             {"version": 20, "accuracy": 0.48, "unix_ms": 11500}, {"version": 30, "accuracy": 0.55, "unix_ms": 17000},
             {"version": 40, "accuracy": 0.6, "unix_ms": 21000}]
    # v10 alone crosses 0.5; the first window of 3 averaging 0.5 ends at v30 (0.58, 0.48, 0.55)
    assert time_to_target(evals, 0.5) == {"seconds": 16.0, "version": 30, "best": 0.6, "seconds_per_version": 0.5}
    assert time_to_target(evals, 0.7)["seconds"] is None and time_to_target(evals, 0.7)["best"] == 0.6
    assert time_to_target([], 0.5)["seconds"] is None


def test_markdown_summary_names_the_machine_and_every_figure():
    result = {
        "machine": {"cores": 2, "cpu": "Test CPU", "memory_gib": 24.0, "gpu": False, "python": "3.11", "torch": "2"},
        "date": "2026-01-01",
        "benchmarks": {
            "weightsync": {"sides": {"grpc_pull_1": {"to_raw_socket": 0.15, "to_memcpy": 0.03, "gib_per_s": 0.5}},
                           "targets": {"grpc_pull_1": 0.7}},
            "transport": {"shapes": [{"shape": "tiny", "bytes_per_rollout": 198, "steadyrl_rollouts_per_s": 5000,
                                      "ratio_steadyrl_to_raw": 0.55}]},
            "inference": {"error": "exit 1"},
            "async": {"target_accuracy": 0.5, "variants": {"sync": {"seconds": 60}, "async_1": {
                "seconds": 40, "speedup_vs_sync": 1.5}}},
        },
    }
    text = markdown(result)
    assert "2 cores of Test CPU, 24.0 GiB, no GPU" in text
    assert ("| weightsync | verified gRPC pull, 1 stream, loaded / raw TCP socket to 1, bf16 (0.5 GiB/s vs raw socket "
            "– GiB/s, memcpy – GiB/s; / memcpy 0.03) | 0.15 | ≥ 0.7 |") in text
    assert "| 0.55 |" in text and "(60 s vs 40 s) | 1.5 | > 1 |" in text
    assert text.rstrip().endswith("Failed: inference (see the JSON).")
