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


def test_a_service_s_own_variable_cannot_set_what_run_declares_for_every_service():
    """With a recipe, [run]'s values are the whole deployment's: one service's STEADYRL_TRAINER_GROUP_SIZE
    would make it disagree with the others on G; the run-wide override is STEADYRL_RECIPE_SET."""
    for name in ("STEADYRL_TRAINER_GROUP_SIZE", "STEADYRL_TRAINER_MAX_STALENESS", "STEADYRL_TRAINER_RUN_ID"):
        with pytest.raises(ValueError, match=f"{name} set what the recipe's \\[run\\] declares"):
            deployed_settings("trainer", {"STEADYRL_RECIPE": RECIPE, name: "4"})
    set_ = deployed_settings("trainer", {"STEADYRL_RECIPE": RECIPE, "STEADYRL_RECIPE_SET": "run.group_size=4"})
    assert set_.group_size == 4
    alone = deployed_settings("trainer", {"STEADYRL_TRAINER_GROUP_SIZE": "4", "STEADYRL_TRAINER_MODEL_PATH": "m"})
    assert alone.group_size == 4  # no recipe: the variables are the whole of it


def test_a_recipe_path_that_is_a_directory_is_named_so(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        deployed_settings("trainer", {"STEADYRL_RECIPE": str(tmp_path)})
    with pytest.raises(ValueError, match="does not exist"):
        deployed_settings("trainer", {"STEADYRL_RECIPE": str(tmp_path / "nothing.toml")})


def test_a_deployed_service_on_the_kit_s_tiny_model_gets_it_built_as_steadyrl_run_does(tiny_model_dir):
    """`steadyrl serve` with the demo recipe (model.path = "tiny") used to fail with a traceback: the kit
    model is built (cached) where the service starts, for the recipe's task."""
    from steadyrl.deploy_cli import kit_model_of

    assert deployed_settings("trainer", {"STEADYRL_RECIPE": RECIPE}).model_path == "tiny"
    assert kit_model_of("tiny", {"STEADYRL_RECIPE": RECIPE}) == str(tiny_model_dir)
    assert kit_model_of("tiny", {}) == str(tiny_model_dir)  # no recipe: the arith task's


@pytest.mark.parametrize("url", ['[1,"HUNTER2SECRET"]', "redis://:HUNTER2SECRET@127.0.0.1:notaport/0", "HUNTER2SECRET"])
def test_a_deployed_service_s_malformed_redis_url_is_refused_when_read_and_never_repeated(url):
    """It used to pass the settings and fail inside the client with a traceback (exit 1, not 2)."""
    with pytest.raises(ValueError, match="redis_url") as refused:
        deployed_settings("trainer", {"STEADYRL_RECIPE": RECIPE, "STEADYRL_TRAINER_REDIS_URL": url})
    assert "HUNTER2SECRET" not in str(refused.value)
