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
