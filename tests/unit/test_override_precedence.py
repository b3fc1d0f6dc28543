"""What docs/reference/settings.md#values-and-precedence says: `--set`'s value syntax, and which value
wins among recipe files, `--set`, STEADYRL_RECIPE_SET and a service's STEADYRL_<SERVICE>_* variables."""

from pathlib import Path

import pytest

from steadyrl.recipe import load_recipe, parse_override
from steadyrl.service_settings import deployed_settings

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "tiny-arith.toml")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("run.steps=10", 10),
        ("trainer.optim.lr=3e-4", 3e-4),
        ("trainer.bypass=true", True),
        ('run.id="x y"', "x y"),
        ("model.path=/models/Qwen3", "/models/Qwen3"),  # not TOML: the text as it is
        ("run.id=true-ish", "true-ish"),
        ("orchestrator.evals.sets=[1, 2]", [1, 2]),
        ("trainer.loss.rejection_bounds={a = 1}", {"a": 1}),
    ],
)
def test_a_set_value_is_a_toml_literal_else_a_string(text, value):
    assert parse_override(text)[2] == value


def test_later_files_then_each_set_in_order_win(tmp_path):
    later = tmp_path / "later.toml"
    later.write_text("[run]\nsteps = 50\n\n[trainer.optim]\nlr = 0.004\n")
    merged = load_recipe([RECIPE, later])
    assert (merged.run.steps, merged.trainer.optim.lr, merged.run.batch_prompts) == (50, 0.004, 32)
    over = load_recipe([RECIPE, later], ["run.steps=7", "run.steps=9", "run.tracking.wandb_project=p"])
    assert (over.run.steps, over.trainer.max_steps, over.orchestrator.steps) == (9, 9, 9)
    assert over.trainer.tracking.wandb_project == over.orchestrator.tracking.wandb_project == "p"
    with pytest.raises(ValueError, match=r"\[run\] declares for every service: set run.steps instead"):
        load_recipe(RECIPE, ["trainer.max_steps=3"])


def test_under_serve_the_service_variables_win_over_the_recipe_set_over_the_files():
    base = {"STEADYRL_RECIPE": RECIPE, "STEADYRL_TRAINER_MODEL_PATH": "/m"}
    assert deployed_settings("trainer", base).optim.lr == 1e-3  # the recipe's
    overridden = {**base, "STEADYRL_RECIPE_SET": "trainer.optim.lr=0.002;trainer.loss.eps_low=0.15"}
    assert deployed_settings("trainer", overridden).optim.lr == 0.002
    own = deployed_settings("trainer", {**overridden, "STEADYRL_TRAINER_LOSS__EPS_LOW": "0.3"})
    assert (own.loss.eps_low, own.loss.eps_high, own.optim.lr) == (0.3, 0.27, 0.002)  # one key replaced
    with pytest.raises(ValueError, match="STEADYRL_TRAINER_GROUP_SIZE set what the recipe's \\[run\\] declares"):
        deployed_settings("trainer", {**base, "STEADYRL_TRAINER_GROUP_SIZE": "4"})
    alone = deployed_settings("trainer", {"STEADYRL_TRAINER_MODEL_PATH": "/m", "STEADYRL_TRAINER_OPTIM__LR": "0.01"})
    assert (alone.optim.lr, alone.max_steps) == (0.01, 0)  # no recipe: the variables over the defaults


def test_a_value_that_spans_lines_is_refused_not_cut():
    """TOML would read `run.steps=5\nsteps=7` as steps 5 and a second key, dropped without a word."""
    for text in ("run.steps=5\nsteps=7", 'run.id="abc"\r\njunk=1'):
        with pytest.raises(ValueError, match="its value spans lines"):
            parse_override(text)


def test_the_resolved_recipe_reads_back_whatever_its_strings_hold(tmp_path):
    import tomllib

    text = 'line1\nline2\x01\x7f tab\t quote" backslash\\ é'
    recipe = load_recipe(RECIPE, [f"orchestrator.data.system_prompt={json_string(text)}"])
    assert recipe.orchestrator.data.system_prompt == text
    back = tomllib.loads(recipe.as_toml())  # config.resolved.toml: a recipe `steadyrl run` takes again
    assert back["orchestrator"]["data"]["system_prompt"] == text
    (tmp_path / "again.toml").write_text(recipe.as_toml())
    assert load_recipe(tmp_path / "again.toml").orchestrator.data.system_prompt == text


def json_string(text: str) -> str:
    """`text` as a TOML basic string (JSON's escapes are TOML's; DEL escaped)."""
    import json

    return json.dumps(text).replace("\x7f", "\\u007f")
