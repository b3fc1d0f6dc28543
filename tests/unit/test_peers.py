"""`steadyrl bench peers`: TRL's GRPOConfig matched to the recipe, and the ratios it prints (the
comparison itself needs TRL's venv: `steadyrl bench peers`)."""

import tomllib
from pathlib import Path

from services.orchestrator.config import OrchestratorSettings
from steadyrl.peers import first_at, ratio
from steadyrl.peers_trl import grpo_config

ROOT = Path(__file__).resolve().parents[2]


def test_trl_gets_the_demo_s_recipe():
    recipe = tomllib.loads((ROOT / "configs" / "tiny-arith.toml").read_text())
    orchestrator = OrchestratorSettings(model_path="m", **recipe["orchestrator"])
    config = grpo_config(recipe, orchestrator, 400, Path("out"))
    assert (config["per_device_train_batch_size"], config["num_generations"]) == (32 * 8, 8)  # B × G, G
    assert (config["max_completion_length"], config["temperature"], config["top_p"]) == (6, 1.0, 1.0)
    assert (config["learning_rate"], config["lr_scheduler_type"], config["max_grad_norm"]) == (1e-3, "constant", 1.0)
    assert (config["beta"], config["scale_rewards"], config["loss_type"]) == (
        0.0,
        "none",
        "dapo",
    )  # R − mean, token-mean
    assert config["num_iterations"] == 1 and config["shuffle_dataset"] is False and config["max_steps"] == 400
    # TRL at its fastest here: no recomputed activations (its default is on), the recipe's whole vocabulary
    assert (config["gradient_checkpointing"], config["top_k"]) == (False, 0)


def test_seconds_to_an_accuracy_and_the_ratios():
    curve = [{"seconds": 1.0, "accuracy": 0.45}, {"seconds": 2.0, "accuracy": 0.61}, {"seconds": 3.0, "accuracy": 0.58}]
    assert first_at(curve, 0.6) == 2.0 and first_at(curve, 0.7) is None
    assert ratio(3.0, 2.0) == 1.5 and ratio(None, 2.0) is None and ratio(1.0, 0) is None


def test_pairs_are_compared_by_their_mean_curves():
    from steadyrl.peers import compare, mean_curve

    base = {"step": 0, "seconds": None, "accuracy": 0.4}
    ours = [
        [base, {"step": 10, "seconds": 0.9, "accuracy": 0.62}, {"step": 20, "seconds": 1.9, "accuracy": 0.7}],
        [base, {"step": 10, "seconds": 1.1, "accuracy": 0.56}, {"step": 20, "seconds": 2.1, "accuracy": 0.66}],
    ]
    trl = [
        [base, {"step": 10, "seconds": 1.2, "accuracy": 0.5}, {"step": 20, "seconds": 2.5, "accuracy": 0.64}],
        [base, {"step": 10, "seconds": 1.4, "accuracy": 0.54}, {"step": 20, "seconds": 2.7, "accuracy": 0.6}],
    ]
    mean = mean_curve(ours)
    assert mean[0] == base and mean[1] == {"step": 10, "seconds": 1.0, "accuracy": 0.59}
    ratios = compare(mean, mean_curve(trl), 20)
    assert ratios["seconds_per_step"] == ratio(0.1053, 0.1368)  # the last point's seconds over its steps
    assert ratios["seconds_to_eval_0.6"] == ratio(2.0, 2.6)  # the mean curves cross 0.6 at step 20 both
    assert ratios["eval_at_equal_steps"] == ratio(0.68, 0.62)


def _peers_result(shipped: dict, off: dict) -> dict:
    from steadyrl.peers import TARGETS

    return {"ratios_as_shipped": shipped, "ratios_evals_off": off, "targets": TARGETS}


def test_each_target_is_judged_on_its_own_side():
    from steadyrl.peers import targets_met

    shipped = {
        "seconds_per_step": 0.58,
        "command_seconds": 0.81,
        "seconds_to_eval_0.6": None,
        "eval_at_equal_steps": 1.0,
    }
    off = {"seconds_per_step": 0.51, "command_seconds": 0.7, "seconds_to_eval_0.6": 0.5, "eval_at_equal_steps": 0.94}
    assert targets_met(_peers_result(shipped, off)) == {
        "seconds_per_step": True,  # 0.58 ≤ 0.6, as shipped
        "seconds_per_step_evals_off": False,  # 0.51 > 0.5
        "command_seconds": False,  # 0.81 > 0.8
        "seconds_to_eval_0.6": None,  # never reached: not judged
        "eval_at_equal_steps": False,  # the worse side, 0.94 < 0.95
    }


def test_the_benchmarks_page_shows_both_sides_trl_s_choices_and_the_load():
    from bench.suite import peer_rows

    side = {"seconds_per_step": 0.1, "command_seconds": 60.0, "trainer_idle_share": 0.05, "replica_idle_share": 0.4}
    ratios = {"seconds_per_step": 0.75, "command_seconds": 0.9, "eval_at_equal_steps": 1.01}
    peers = {
        "steps": 400,
        "trl": {
            "seconds_per_step": 0.134,
            "command_seconds": 66.0,
            "chosen": {"gradient_checkpointing": {"value": False}, "top_k": {"value": 0}},
            "load": [{"load_1min_before": 0.31, "machine_busy_share": 0.52}],
        },
        "steadyrl_as_shipped": {**side, "load": [{"load_1min_before": 1.2, "machine_busy_share": 0.9}]},
        "steadyrl_evals_off": side,
        "ratios_as_shipped": ratios,
        "ratios_evals_off": {**ratios, "seconds_per_step": 0.66},
        "pair_ratios_as_shipped": [ratios],
        "targets": {"seconds_per_step": 0.6, "seconds_per_step_evals_off": 0.5, "command_seconds": 0.8},
    }
    rows = peer_rows(peers)
    assert "gradient_checkpointing = False, top_k = 0" in rows[0] and rows[0].endswith("| 0.75 | ≤ 0.6 |")
    assert rows[1].endswith("| 0.66 | ≤ 0.5 |") and rows[2].endswith("| 0.9 | ≤ 0.8 |")
    assert "TRL 0.31/0.52; as shipped 1.2/0.9; evals off –" in rows[-1]


def test_the_machine_s_load_is_measured_around_a_run():
    from bench.load import Load, machine_ticks

    busy, total = machine_ticks()
    assert 0 < busy < total
    with Load() as load:
        sum(i * i for i in range(2_000_000))  # this process keeps one core busy meanwhile
    record = load.record()
    assert record["load_1min_before"] >= 0 and 0 < record["machine_busy_share"] <= 1
