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
    from shared.rollouts.record import RolloutLimits, decode_rollout, encode_rollout, validate_rollout

    shape = {"prompt": 5, "completion": 7, "layers": 3, "top_k": 4, "experts": 6, "rollouts": 9}
    limits = RolloutLimits(num_layers=3, top_k=4, num_experts=6, max_version=7)
    for rollout in make_rollouts(shape):
        back = validate_rollout(decode_rollout(encode_rollout(rollout), limits), limits)
        assert back.routing_trace.shape == (11, 3, 4)


# slow: every transport's delivery, bit-exact and refusing bad versions, is
# tests/integration/test_weight_transports.py's; the bench's tables are test_bench_suite's
@pytest.mark.slow
def test_weight_bench_refits_every_transport_end_to_end_on_one_clock():
    """A 1-layer model (108 MB in bf16), one untimed and one timed round: every transport into 1 and
    2 torch-engine replicas, each side against memcpy of the same bytes, the ratios the targets name
    computed from the sides themselves."""
    from bench.weightsync import TRANSPORTS, main

    result = main(layers=1, rounds=1, engines=("torch",), replicas=(1, 2), warmup=1)
    nbytes = result["model"]["bytes"]
    memcpy = result["machine"]["memcpy"]["seconds"]
    assert 100e6 < nbytes < 120e6 and memcpy > 0 and result["machine"]["raw_socket_1"]["seconds"] > 0
    # the shm transport's own work alone casts, writes, hashes twice and copies: more than a memcpy or
    # one hash, less than the refit that adds a service, an announcement and an engine around it
    blake3 = result["machine"]["blake3_1_thread"]["seconds"]
    floor = result["machine"]["shm_floor"]["seconds"]
    assert memcpy < floor and blake3 < floor
    refit = result["refit"]["torch"]
    assert set(refit) == {"1", "2"} and all(set(sides) == set(TRANSPORTS) for sides in refit.values())
    for count, sides in refit.items():
        for transport, side in sides.items():
            assert side["transports"] == [transport], (count, transport)  # every replica took it that way
            assert 0 < side["trainer_publish_seconds"] <= side["seconds"]
            assert side["to_memcpy"] == pytest.approx(memcpy / side["seconds"], rel=0.05, abs=2e-3)  # rounded sides
            assert 0 <= side["paused_seconds"] < side["seconds"]
            # the step changes most bf16 elements' low bytes: a delta pull carries part of the bytes
            assert side["wire_bytes_share"] == 0 if transport != "grpc" else 0 < side["wire_bytes_share"] < 1
    assert result["ratios"]["two_over_one"]["torch"] == {
        t: round(refit["1"][t]["seconds"] / refit["2"][t]["seconds"], 3) for t in TRANSPORTS
    }
    assert result["ratios"]["shm_to_memcpy"]["torch"] == refit["1"]["shm"]["to_memcpy"]
    assert result["ratios"]["shm_to_floor"]["torch"] == pytest.approx(
        floor / refit["1"]["shm"]["seconds"], abs=2e-3
    )  # from the rounded sides
    lines = markdown(
        {
            "machine": {"cores": 2, "cpu": "x", "memory_gib": 1, "gpu": False, "python": "3", "torch": "2"},
            "date": "d",
            "benchmarks": {"weightsync": result},
        }
    ).splitlines()
    rows = [line for line in lines if "refit, torch" in line]
    assert len(rows) == 2 * len(TRANSPORTS)
    floor_rows = [line for line in lines if "own work" in line]
    assert len(floor_rows) == 2 and f"({round(floor, 4)} s)" in floor_rows[0]


def test_time_to_target():
    evals = [
        {"version": 0, "accuracy": 0.4, "unix_ms": 1000},
        {"version": 10, "accuracy": 0.58, "unix_ms": 6000},
        {"version": 20, "accuracy": 0.48, "unix_ms": 11500},
        {"version": 30, "accuracy": 0.55, "unix_ms": 17000},
        {"version": 40, "accuracy": 0.6, "unix_ms": 21000},
    ]
    # v10 alone crosses 0.5; the first window of 3 averaging 0.5 ends at v30 (0.58, 0.48, 0.55)
    assert time_to_target(evals, 0.5) == {"seconds": 16.0, "version": 30, "best": 0.6, "seconds_per_version": 0.5}
    assert time_to_target(evals, 0.7)["seconds"] is None and time_to_target(evals, 0.7)["best"] == 0.6
    assert time_to_target([], 0.5)["seconds"] is None


def test_markdown_summary_names_the_machine_and_every_figure():
    result = {
        "machine": {"cores": 2, "cpu": "Test CPU", "memory_gib": 24.0, "gpu": False, "python": "3.11", "torch": "2"},
        "date": "2026-01-01",
        "benchmarks": {
            "weightsync": {
                "model": {"bytes": 2**30},
                "machine": {"memcpy": {"gib_per_s": 20.0}, "raw_socket_1": {"gib_per_s": 3.0, "to_memcpy": 0.15}},
                "refit": {
                    "torch": {
                        "1": {
                            "shm": {
                                "seconds": 0.5,
                                "trainer_publish_seconds": 0.3,
                                "paused_seconds": 0.1,
                                "wire_bytes_share": 0.0,
                                "anon_peak_growth_bytes": 2**20,
                                "to_memcpy": 0.1,
                            }
                        }
                    }
                },
                "ratios": {"two_over_one": {"torch": {"shm": 0.9}}},
                "targets": {"shm_to_memcpy": 0.25, "two_over_one": 0.8},
            },
            "transport": {
                "shapes": [
                    {
                        "shape": "tiny",
                        "bytes_per_rollout": 198,
                        "steadyrl_rollouts_per_s": 5000,
                        "ratio_steadyrl_to_raw": 0.55,
                    }
                ]
            },
            "inference": {"error": "exit 1"},
            "async": {
                "target_accuracy": 0.5,
                "variants": {"sync": {"seconds": 60}, "async_1": {"seconds": 40, "speedup_vs_sync": 1.5}},
            },
        },
    }
    text = markdown(result)
    assert "2 cores of Test CPU, 24.0 GiB, no GPU" in text
    assert "| weightsync | raw loopback TCP socket / memcpy (3.0 vs 20.0 GiB/s, 1.0 GiB) | 0.15 | – |" in text
    assert (
        "| weightsync | refit, torch engine, 1 replica(s), shm: memcpy / last optimizer step → first token of the "
        "version on every replica (0.5 s, trainer's publish 0.3 s, paused 0.1 s, wire 0.0 of the bytes, peak "
        "private growth 1 MiB) | 0.1 | ≥ 0.25 |"
    ) in text
    assert "| weightsync | rate with 2 replicas / with 1 (seconds 1 / seconds 2), torch | shm 0.9 | ≥ 0.8 |" in text
    assert "| 0.55 |" in text and "(60 s vs 40 s) | 1.5 | > 1 |" in text
    assert text.rstrip().endswith("Failed: inference (see the JSON).")


def test_checkpoint_bench_parts_measure_what_they_say(tmp_path):
    """The cheap parts of `bench trainer --checkpoint` (the whole runs for minutes): the trace
    bytes of a 30B-A3B-shaped trace, the resident-memory sampler, the machine's write limit."""
    import time

    import numpy as np

    from bench.trainer_checkpoint import machine_limits, peak_growth, trace_bytes

    trace = trace_bytes()
    assert trace["uint8_bytes_per_token"] == 384 and trace["uint16_bytes_per_token"] == 768
    assert 0.86 < trace["random"]["over_uint8"] <= 0.876  # uniformly random top-8 of 128: the 7-bit bound
    assert trace["repeated_half"]["over_uint8"] < 0.6
    with peak_growth() as peak:
        block = np.ones(64 * 2**20, dtype=np.uint8)  # 64 MiB touched, held for 10 samples
        time.sleep(0.05)
        del block
    assert peak["anon_peak_growth"] >= 60 * 2**20
    limits = machine_limits(8 * 2**20, str(tmp_path))
    assert limits["bytes"] == 8 * 2**20 and limits["memcpy_seconds"] > 0 and limits["write_fsync_seconds"] > 0
    assert not list(tmp_path.iterdir())
    text = markdown(
        {
            "machine": {"cores": 2, "cpu": "c", "memory_gib": 1, "gpu": False, "python": "3", "torch": "2"},
            "date": "2026-01-01",
            "benchmarks": {
                "trainer_checkpoint": {
                    "parameters": 5,
                    "rank0_rss_growth_dcp_over_full_gather": 0.09,
                    "step_during_async_save_over_plain": 1.5,
                    "save_seconds": {"full_gather": 14.0},
                    "trace": trace,
                }
            },
        }
    )
    assert (
        "| trainer checkpoint | rank 0's memory growth during a save, DCP blocking / full gather, 2 gloo ranks "
        "(FSDP), 5-parameter MoE | 0.09 | ≤ 0.6 |" in text
    )
    assert "| trainer checkpoint | step while an async save is written / a step without one | 1.5 | ≤ 1.2 |" in text


# slow: adapter versions by every transport are tests/integration/test_lora_versions.py's
@pytest.mark.slow
def test_lora_refit_bench_times_adapter_versions_against_full_ones_on_one_clock():
    """bench/lora.py's refit sides on a 1-layer model, one untimed and one timed round: full and
    adapter-only versions into a torch replica by every transport, the ratios computed from the sides."""
    from bench.lora import refit_sides
    from bench.weightsync import TRANSPORTS

    out = refit_sides(layers=1, rounds=1, warmup=1)
    assert 100e6 < out["model"]["bytes"] < 120e6 and out["memcpy_seconds"] > 0
    for side in ("full", "lora"):
        assert set(out["seconds"][side]) == set(TRANSPORTS) and all(s > 0 for s in out["seconds"][side].values())
    assert out["lora_over_full_seconds"] == {
        t: round(out["seconds"]["lora"][t] / out["seconds"]["full"][t], 3) for t in TRANSPORTS
    }
    assert set(out["lora_over_full_paused_seconds"]) == set(TRANSPORTS)


def test_lora_peak_memory_is_measured_with_each_side_alone_in_its_own_process(tiny_model_dir):
    """bench/lora.py's peak sides: each side's high-water mark, reset once its model is loaded, in a
    process of its own; the full side's step holds every weight's gradient and AdamW moments
    (3 × 4 bytes each of the wider model's fp32 weights beyond the adapter's), LoRA's the adapter's."""
    from bench.lora import peak_sides
    from bench.trainer import wider_model

    out = peak_sides(tiny_model_dir, rounds=1)
    full = out["peak"]["full"]
    lora = out["peak"]["lora"]
    for side in (full, lora):
        assert side["peak_bytes"] >= side["loaded_bytes"] > 100e6
        assert side["step_peak_bytes"] == side["peak_bytes"] - side["loaded_bytes"]
    weights = sum(p.numel() for p in wider_model(tiny_model_dir).parameters()) * 4
    assert full["step_peak_bytes"] > 2 * weights  # at least the gradients and two AdamW moments' worth, less slack
    assert full["step_peak_bytes"] - lora["step_peak_bytes"] > weights  # LoRA holds no per-weight state
    assert out["lora_over_full_step_peak_bytes"] == round(lora["step_peak_bytes"] / full["step_peak_bytes"], 3)


def test_the_full_batch_line_times_the_engine_and_generate_on_the_same_batch():
    """bench.inference's demo step in one batch: the torch engine (with and without traces) and transformers'
    `generate` on the same 256 sequences; the ratio is the engine's rate over generate's (one round: exactly)."""
    from bench.inference import full_batch

    side = full_batch("float32", rounds=1)
    assert (side["sequences"], side["new_tokens"], side["threads"]) == (256, 6, 1)
    rates = [side[f"{name}_tokens_per_s"] for name in ("generate", "engine", "engine_traces")]
    assert all(rate > 0 for rate in rates), side
    # the ratios are rounded to 3 places, the rates to 1: equal within the rounding (a ratio of 0.14 read 0.13979)
    assert side["engine_over_generate"] == pytest.approx(rates[1] / rates[0], abs=6e-4)
    assert side["engine_traces_over_generate"] == pytest.approx(rates[2] / rates[0], abs=6e-4)
    by_group = side["engine_by_group_tokens_per_s"]  # the same work, its groups started one after another
    assert by_group > 0 and side["by_group_over_one_batch"] == pytest.approx(by_group / rates[1], abs=6e-4)


def test_the_patch_bench_alternates_transports_and_sides_on_one_clock(tmp_path, tiny_model_dir):
    """bench/weight_patches.py's rounds on the demo's model: shm and collective, whole and patch, each round in turn
    (the order reversed every other round); each version is served by the transport it was published by, the whole
    side sends the model's bytes and every patch version is a patch against the version before it (the replica's)."""
    from bench.patch_roles import COMBOS
    from bench.weight_patches import WARMUP, rounds_of, summarise

    records = rounds_of(tiny_model_dir, 1e-6, 4, tmp_path)
    assert [(r["transport"], r["side"]) for r in records] == [*reversed(COMBOS), *COMBOS]  # after a warm-up round
    assert [r["version"] for r in records] == list(range(WARMUP + 1, WARMUP + 9))
    assert all(r["served_by"] == r["transport"] for r in records)  # no patch version taken whole (by grpc)
    model = records[1]["whole_bytes"]
    assert all(r["whole_bytes"] == model and r["patch_bytes"] == 0 for r in records if r["side"] == "whole")
    patched = [r for r in records if r["side"] == "patch"]
    assert all(r["patch_base"] == r["version"] - 1 for r in patched)
    assert all(r["patch_bytes"] > 0 and r["whole_bytes"] + r["patch_bytes"] < 0.5 * model for r in patched)
    summary = summarise(records, model)
    assert summary["pairs"] == 2 and summary["bytes_patch_over_whole"] < 0.5
    assert 0 < summary["changed_share"][0] <= summary["changed_share"][1] < 0.5
    for transport, side in summary["by_transport"].items():
        assert side["pairs"] == 2 and side["versions"] == 4 and side["patch_taken_whole"] == 0
        assert side["transports"] == [transport] and side["bytes_patch_over_whole"] < 0.5
    assert summary["refit_seconds"] == summary["by_transport"]["shm"]["refit_seconds"]
