"""STEADYRL_RECIPE_SET: a deployment's `--set` overrides of its recipe, the same for every service."""

from pathlib import Path

import pytest

from steadyrl.service_settings import deployed_settings, recipe_overrides

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-arith.toml")


def test_overrides_split_on_lines_and_semicolons():
    text = "run.steps=30; trainer.optim.lr=0.002\n\n  orchestrator.evals.every=5 ;"
    assert recipe_overrides({"STEADYRL_RECIPE_SET": text}) == [
        "run.steps=30",
        "trainer.optim.lr=0.002",
        "orchestrator.evals.every=5",
    ]
    assert recipe_overrides({}) == []


def test_every_service_resolves_the_overridden_recipe():
    env = {"STEADYRL_RECIPE": RECIPE, "STEADYRL_RECIPE_SET": "run.steps=30;trainer.optim.lr=0.002"}
    plain = deployed_settings("trainer", {"STEADYRL_RECIPE": RECIPE})
    trainer = deployed_settings("trainer", env)
    orchestrator = deployed_settings("orchestrator", env)
    assert (plain.max_steps, plain.optim.lr) == (400, 1e-3)
    assert (trainer.max_steps, trainer.optim.lr) == (30, 0.002)
    assert orchestrator.steps == 30


def test_a_bad_override_is_refused_with_its_name():
    with pytest.raises(ValueError, match="nosuch"):
        deployed_settings("trainer", {"STEADYRL_RECIPE": RECIPE, "STEADYRL_RECIPE_SET": "trainer.nosuch=1"})
