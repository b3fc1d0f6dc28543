"""The auto recipe: replay and clipping per step (the paper's §4), and the objective per run (the
objective arena's staleness finding, docs/REPRODUCTION.md), with the committed evidence behind it."""

from pathlib import Path

import pytest

from services.trainer.config import TrainerSettings
from services.trainer.global_step import STALE_DPPO, resolve_objective
from services.trainer.model_runner import choose_recipe
from steadyrl.grid import load_grid, recipe_for
from steadyrl.verdicts import ARENA_RESULTS, arena_cell, matching, read_runs

ROOT = Path(__file__).resolve().parents[2]


def settings(**values) -> TrainerSettings:
    return TrainerSettings(model_path="m", unsigned_weights=True, **values)


@pytest.mark.parametrize(
    ("values", "peak", "name", "objective"),
    [
        ({}, 0, "minirl+tis+clip", "minirl"),
        ({"max_staleness": 2}, 2, "minirl+tis+clip+r3", "minirl"),
        ({"max_staleness": STALE_DPPO - 1}, 3, "minirl+tis+clip+r3", "minirl"),
        ({"max_staleness": STALE_DPPO}, 0, "dppo+tis+clip", "dppo"),  # the run's bound, not the step's peak
        ({"max_staleness": 8}, 5, "dppo+tis+clip+r3", "dppo"),
        ({"max_staleness": 8, "loss": {"objective": "grpo"}}, 5, "grpo+tis+clip+r3", "grpo"),
        ({"max_staleness": 8, "recipe": "manual"}, 5, "minirl+tis+clip", "minirl"),
    ],
)
def test_the_auto_recipe_trains_dppo_from_staleness_4_and_keeps_a_chosen_objective(values, peak, name, objective):
    config, recipe, why = choose_recipe(settings(**values), peak, has_traces=True, is_moe=True)
    assert (recipe, config.loss.objective) == (name, objective)
    assert ("objective arena" in why) == (objective == "dppo")
    assert config.loss.clip is True and config.loss.dppo_delta_low == 0.15


def test_the_objective_choice_is_pure_and_once_per_run():
    assert resolve_objective("minirl", STALE_DPPO - 1) == ("minirl", "")
    assert resolve_objective("minirl", STALE_DPPO)[0] == "dppo"
    assert resolve_objective("cispo", 100) == ("cispo", "")


def test_the_committed_arena_runs_show_dppo_more_stable_than_minirl_from_that_staleness():
    """The choice rests on the committed per-run results: under each staleness stress at or above
    STALE_DPPO, DPPO is "more stable" than MiniRL by the page's rule, with 12 runs a cell; under
    the lowest of them the grid's stress has exactly that bound."""
    grid = load_grid(ROOT / "configs" / "arena.toml")
    runs = read_runs(ARENA_RESULTS, ROOT / "docs" / "reproduction")
    bounds = {}
    for stress in ("stale4", "stale8"):
        config = next(c for c in grid.configs if c.name == f"{stress}-dppo")
        bounds[stress] = recipe_for(grid, config, 0).run.max_staleness
        assert "more stable" in arena_cell("dppo", stress, runs)
        for objective in ("minirl", "dppo"):
            assert len(matching(runs, (f"{stress}-{objective}",))) >= 12
    assert min(bounds.values()) == STALE_DPPO
