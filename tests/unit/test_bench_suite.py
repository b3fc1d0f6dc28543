"""`steadyrl bench all --only X --update`: the other benchmarks keep their dated figures."""

import pytest

from bench.suite import machine, main, markdown


def test_an_update_keeps_earlier_figures_dated_and_refuses_another_machine():
    earlier = {
        "machine": machine(),
        "date": "2026-01-02",
        "benchmarks": {
            "weightsync": {
                "ratios": {"two_over_one": {"torch": {"collective": 0.97}}},
                "targets": {"two_over_one": 0.8},
            },
            "inference": {"service_to_bare_ratio": 0.8, "date": "2026-01-01"},
        },
    }
    merged = main(["no-such-benchmark"], earlier)  # runs nothing: only the merge
    assert list(merged["benchmarks"]) == ["weightsync", "inference"]
    assert merged["benchmarks"]["weightsync"]["date"] == "2026-01-02"
    assert merged["benchmarks"]["inference"]["date"] == "2026-01-01"
    text = markdown(merged)
    assert "weightsync 2026-01-02, inference 2026-01-01" in text
    assert (
        "| weightsync | rate with 2 replicas / with 1 (seconds 1 / seconds 2), torch | collective 0.97 | ≥ 0.8 |"
        in text
    )
    with pytest.raises(ValueError, match="another machine"):
        main([], {**earlier, "machine": {"cpu": "elsewhere"}})


def test_the_lora_bench_counts_adapter_bytes_by_the_shapes():
    """bench.lora's bytes per version, against the formula: rank r on q, k, v, o of every layer is
    r · (in + out) per matrix; the experts add r · (in + out) per expert per stacked tensor."""
    from bench.lora import version_bytes
    from bench.suite import markdown

    h = 64
    layers = 2
    heads = 4
    kv = 2
    hd = 16
    experts = 4
    inter = 32
    r = 32
    shape = {
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": inter,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    out = version_bytes(shape)
    attention = layers * r * ((h + heads * hd) * 2 + (h + kv * hd) * 2)
    assert out["attention"]["adapter_bytes"] == 2 * attention  # bf16
    expert = layers * experts * r * ((h + 2 * inter) + (inter + h))
    assert out["attention_experts"]["adapter_bytes"] == 2 * (attention + expert)
    assert out["full_bytes"] == 2 * out["parameters"]
    result = {
        "machine": {"cores": 2, "cpu": "c", "memory_gib": 1, "gpu": False, "python": "3", "torch": "2"},
        "date": "d",
        "benchmarks": {"lora": {"rank": 32, "targets": {"adapter_over_full": 0.05}, "versions": {"tiny": out}}},
    }
    assert f"| lora | tiny ({out['parameters']:,} parameters), rank 32, attention: adapter bytes" in markdown(result)


def test_the_dynamic_sampling_bench_counts_tokens_and_filtered_groups_by_hand():
    """bench.dynamic_sampling's summary of one run: tokens and seconds from the end of step 1 to the
    end of the last, the filtered share over every group that completed (B = 2 trained a step)."""
    from bench.dynamic_sampling import summarise

    lines = [  # three steps one second apart; step 2 trained a group with equal rewards (share 0.5)
        {"step": 1, "unix_ms": 1000, "tokens": 50, "filtered_groups": 1, "zero_variance_share": 0.0},
        {"step": 2, "unix_ms": 2000, "tokens": 40, "filtered_groups": 3, "zero_variance_share": 0.5},
        {"step": 3, "unix_ms": 3000, "tokens": 60, "filtered_groups": 0, "zero_variance_share": 0.0},
    ]
    evals = [{"version": 3, "accuracy": 0.5}, {"version": 0, "accuracy": 0.25}]
    out = summarise(lines, evals, batch_prompts=2)
    assert out["seconds"] == 2.0 and out["tokens_trained_per_s"] == 50.0  # (40 + 60) / 2
    assert out["informative_tokens_per_s"] == 40.0  # (40 × 0.5 + 60) / 2
    assert out["filtered_groups"] == 4 and out["filtered_share"] == 0.4  # 4 / (4 + 3 × 2)
    assert out["zero_variance_share_trained"] == round(0.5 / 3, 4)
    assert out["evals"] == {0: 0.25, 3: 0.5}


def test_the_pools_bench_counts_steps_to_target_and_rollouts_by_hand():
    from bench.pools import rollouts_per_second, steps_to

    evals = [{"version": v, "accuracy": a} for v, a in [(20, 0.62), (0, 0.4), (10, 0.58), (30, 0.5)]]
    assert steps_to(evals, 0.6) == 20  # (0.58 + 0.62) / 2: one lucky eval alone does not decide
    assert steps_to(evals, 0.61) is None
    lines = [{"step": 2, "unix_ms": 3000}, {"step": 1, "unix_ms": 1000}, {"step": 3, "unix_ms": 5000}]
    assert rollouts_per_second(lines, 256) == 128.0  # 2 steps × 256 rollouts in 4 s
    assert rollouts_per_second(lines[:1], 256) is None


def test_the_pools_bench_sums_a_judged_run_by_hand():
    from bench.pools import judged_run

    lines = [{"step": s, "unix_ms": 1000 * s, "judge_agreement": a} for s, a in enumerate([0.5, 0.7, 0.9, 0.9], 1)]
    evals = [{"version": v, "accuracy": a} for v, a in [(4, 0.5), (0, 0.4), (2, 0.65)]]
    out = judged_run(lines, evals, batch=10)
    assert out["eval_gain_end"] == 0.1 and out["eval_gain_best"] == 0.25
    assert out["judge_agreement_mean"] == 0.75  # (0.5 + 0.7 + 0.9 + 0.9) / 4
    assert (out["judge_agreement_first_tenth"], out["judge_agreement_last_tenth"]) == (0.5, 0.9)  # a step each
    assert out["rollouts_per_s"] == 10.0 and out["evals"] == {0: 0.4, 2: 0.65, 4: 0.5}


def test_the_benchmarks_page_gives_the_control_threads_cpu_against_its_target():
    threads = {
        "steps": 55,
        "seconds_per_step": 0.09,
        "cpu_ms_per_step": {"trainer": {"asyncio_0": 33.8}, "inference": {"torch-engine": 31.6}},
        "control_ms_per_step": {
            "inference.main": 10.5,
            "trainer.main": 13.3,
            "orchestrator.*": 5.1,
            "redis.*": 5.1,
            "total": 34.0,
        },
    }

    def page_of(costs: dict) -> str:
        return markdown(
            {"machine": machine(), "date": "2026-12-07", "benchmarks": {"trainer": {"demo_step_costs": costs}}}
        )

    page = page_of({"threads": threads, "control_target_ms": 20})
    (row,) = [line for line in page.splitlines() if "control threads" in line]
    assert "inference.main 10.5, trainer.main 13.3, orchestrator.* 5.1, redis.* 5.1" in row
    assert "trainer.asyncio_0 33.8, inference.torch-engine 31.6" in row and row.endswith("| 34.0 ms | ≤ 20 ms |")
    assert "control threads" not in page_of({})  # none measured: no row


def test_the_benchmarks_page_gives_the_shared_prefix_step_against_whole_rows():
    shared = {
        "rows": 256,
        "step_seconds_whole_rows": 0.0544,
        "step_seconds_shared_prefix": 0.0359,
        "shared_over_whole": 0.659,
        "shared_over_whole_spread": [0.596, 0.933],
        "pairs": 10,
    }

    def page_of(trainer: dict) -> str:
        return markdown({"machine": machine(), "date": "2026-12-07", "benchmarks": {"trainer": trainer}})

    (row,) = [line for line in page_of({"shared_prefix": shared}).splitlines() if "prefix once" in line]
    assert "(0.0359 vs 0.0544 s; 10 interleaved pairs 0.596–0.933) | 0.659 | – |" in row
    assert "256 rows" in row
    assert "prefix once" not in page_of({})  # none measured: no row


def test_the_patch_rows_say_bytes_and_seconds_beside_their_targets():
    from bench.suite import patch_rows

    side = {
        "changed_share": [0.027, 0.028],
        "bytes_patch_over_whole": 0.018,
        "refit_seconds": {"whole": 0.25, "patch": 0.5},
        "refit_patch_over_whole": 2.0,
        "refit_patch_over_whole_spread": [1.8, 2.4],
        "pairs": 9,
        "paused_seconds": {"whole": 0.02, "patch": 0.07},
    }
    targets = {"patch_over_whole_bytes": 0.05, "patch_over_whole_refit": 0.2, "demo_whole_over_patch_refit": 0.98}
    rows = patch_rows({"targets": targets, "qwen3_100m": side, "demo": side})  # shm's alone, as results were
    assert rows[0] == (
        "| weight_patches | ~108M Qwen3-MoE, lr 1e-6: bytes per version, patch / whole (bf16 elements changed per "
        "step 0.027–0.028) | 0.018 | ≤ 0.05 |"
    )
    assert rows[1] == (
        "| weight_patches | ~108M Qwen3-MoE, lr 1e-6: refit seconds by shm, patch / whole (0.5 vs 0.25 s; "
        "spread 1.8–2.4 over 9 pairs; paused 0.07 vs 0.02 s) | 2.0 | ≤ 0.2 |"
    )
    assert rows[3].endswith("| 2.0 | ≤ 1.02 |") and rows[2].endswith("| 0.018 | – |") and len(rows) == 4

    collective = {
        **side,
        "refit_seconds": {"whole": 0.3, "patch": 0.045},
        "refit_patch_over_whole": 0.15,
        "refit_patch_over_whole_spread": [0.12, 0.19],
        "paused_seconds": {"whole": 0.03, "patch": 0.01},
        "patch_taken_whole": 1,
    }
    each = {**side, "by_transport": {"shm": {**side, "patch_taken_whole": 0}, "collective": collective}}
    rows = patch_rows({"targets": targets, "qwen3_100m": each, "demo": each})  # a row per transport
    assert len(rows) == 6 and rows[1] == (
        "| weight_patches | ~108M Qwen3-MoE, lr 1e-6: refit seconds by shm, patch / whole (0.5 vs 0.25 s; "
        "spread 1.8–2.4 over 9 pairs; paused 0.07 vs 0.02 s) | 2.0 | ≤ 0.2 |"
    )
    assert rows[2] == (
        "| weight_patches | ~108M Qwen3-MoE, lr 1e-6: refit seconds by collective, patch / whole (0.045 vs 0.3 s; "
        "spread 0.12–0.19 over 9 pairs; paused 0.01 vs 0.03 s; 1 patch versions taken whole) | 0.15 | ≤ 0.2 |"
    )
    assert rows[4].endswith("| 2.0 | ≤ 1.02 |") and rows[5].endswith("| 0.15 | ≤ 1.02 |")


def test_the_patch_summary_keeps_shm_at_the_top_and_each_transport_beside():
    """bench/weight_patches.py `summarise` on made-up records: medians, pair ratios and bytes per transport, and a
    patch version the replica took whole (by grpc) counted against its transport."""
    from bench.weight_patches import summarise

    def record(transport, side, version, seconds, served=None, patch_bytes=20):
        whole = side == "whole"
        return {
            "transport": transport,
            "side": side,
            "version": version,
            "seconds": seconds,
            "paused_seconds": seconds / 10,
            "served_by": served or transport,
            "changed_share": version / 100,
            "whole_bytes": 1000 if whole else 100,
            "patch_bytes": 0 if whole else patch_bytes,
            "patch_base": 0 if whole else version - 1,
        }

    records = [
        record("collective", "patch", 5, 0.05, served="grpc"),
        record("collective", "whole", 6, 0.5),
        record("shm", "patch", 7, 0.1, patch_bytes=20),
        record("shm", "whole", 8, 0.4),
        record("shm", "whole", 9, 0.2),
        record("shm", "patch", 10, 0.3, patch_bytes=40),
        record("collective", "whole", 11, 0.5),
        record("collective", "patch", 12, 0.15),
    ]
    summary = summarise(records, 1000)
    shm, collective = summary["by_transport"]["shm"], summary["by_transport"]["collective"]
    assert summary["model_bytes"] == 1000 and summary["versions"] == 4 and summary["pairs"] == 2
    assert summary["refit_seconds"] == {"whole": 0.3, "patch": 0.2} == shm["refit_seconds"]
    assert summary["refit_patch_over_whole"] == 0.667 and shm["refit_whole_over_patch"] == 1.5
    assert summary["refit_patch_over_whole_spread"] == [0.25, 1.5]  # 0.1 / 0.4 and 0.3 / 0.2
    assert summary["paused_seconds"] == {"whole": 0.03, "patch": 0.02}
    assert summary["bytes_patch_over_whole"] == 0.13 and summary["bytes_patch_over_whole_range"] == [0.12, 0.14]
    assert summary["changed_share"] == [0.07, 0.1] and summary["transports"] == ["shm"]
    assert shm["patch_taken_whole"] == 0 and "patch_taken_whole" not in summary
    assert collective["refit_seconds"] == {"whole": 0.5, "patch": 0.1}
    assert collective["refit_patch_over_whole"] == 0.2 and collective["refit_patch_over_whole_spread"] == [0.1, 0.3]
    assert collective["patch_taken_whole"] == 1 and collective["transports"] == ["collective", "grpc"]
