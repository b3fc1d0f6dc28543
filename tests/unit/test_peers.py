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
