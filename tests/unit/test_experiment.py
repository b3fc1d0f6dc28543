"""The experiment grid: loading, per-run summaries with the collapse rule, aggregation over seeds."""

import json
import math
from pathlib import Path

import pytest

from steadyrl.experiment import check_recipes
from steadyrl.grid import aggregate, load_grid, markdown_table, recipe_for, summarise_run
from steadyrl.grid_plots import mean_curve, moving_mean, plot_grid

ROOT = Path(__file__).resolve().parents[2]


def steps(n, **fixed):
    return [
        {
            "step": s,
            "version": s,
            "reward_mean": s / n,
            "entropy": 0.5 - 0.004 * s,
            "mismatch_kl_k3": 1e-3,
            "is_weight_max": 1.0 + s / 100,
            "is_weight_mean": 1.0,
            "clip_frac": 0.01,
            "routing_agreement": 0.99,
            "grad_norm": 1.0,
            "loss": 0.1,
            **fixed,
        }
        for s in range(1, n + 1)
    ]


@pytest.mark.parametrize(
    "name,configs", [("paper-grid.toml", 11), ("paper-grid-v2.toml", 12), ("paper-grid-fp4.toml", 17)]
)
def test_the_paper_grids_load_and_every_run_recipe_validates(name, configs):
    from steadyrl.recipe import PROBES, SERVICES
    from steadyrl.service_settings import service_env, validate

    grid = load_grid(ROOT / "configs" / name)
    names = [c.name for c in grid.configs]
    assert len(names) == configs and len(set(names)) == configs
    for config in grid.configs:
        recipe = recipe_for(grid, config, seed=2)
        assert recipe.section("trainer")["seed"] == 2 and recipe.section("orchestrator")["data"]["seed"] == 2
        assert recipe.run_id == f"{config.name}-s2"
        for service in SERVICES:  # a typo in a configuration names the field
            validate(service, service_env(recipe, service, PROBES[service]))
        assert recipe.section("inference")["dtype"] == "bfloat16"  # vs the trainer's fp32
        if name == "paper-grid-v2.toml":  # the paper's geometry: the mini-batch fixed, B = N × it
            assert recipe.run.batch_prompts == 8 * recipe.section("trainer")["mini_batches"]
            assert recipe.section("inference")["quantization"] == "fp8"
        if name == "paper-grid-fp4.toml":  # NVFP4 W4A4 inference, the paper's geometry, π scored in fp32
            assert recipe.section("inference")["quantization"] == "fp4"
            assert recipe.section("inference")["quantize_activations"] is True
            assert recipe.run.batch_prompts == 16 * recipe.section("trainer")["mini_batches"]
    assert grid.eval_final_model == ("float32" if name == "paper-grid-fp4.toml" else "")
    assert (
        ("final_model_drop" in grid.collapse)
        == ("policy_eval_drop" in grid.collapse)
        == (name == "paper-grid-fp4.toml")
    )
    check_recipes(grid, grid.configs)  # what its collapse rules read, every configuration produces


def test_the_arena_is_every_stress_times_every_objective_and_every_recipe_validates():
    from steadyrl.recipe import PROBES, SERVICES
    from steadyrl.service_settings import service_env, validate

    grid = load_grid(ROOT / "configs" / "arena.toml")
    stresses = ("fp4", "fp8", "stale4", "stale8", "n4", "n4r2", "n4r3", "exact")
    objectives = ("minirl", "grpo", "dppo", "gspo", "cispo")
    assert [c.name for c in grid.configs] == [f"{s}-{o}" for s in stresses for o in objectives]
    for config in grid.configs:
        recipe = recipe_for(grid, config, seed=3)
        for service in SERVICES:
            validate(service, service_env(recipe, service, PROBES[service]))
        stress, objective = config.name.split("-")
        assert recipe.trainer.loss.objective == objective and recipe.trainer.optim.lr == 2e-3
        assert recipe.run.steps == 300 and recipe.run.exact == (stress == "exact")
        assert recipe.inference.quantization == {"fp4": "fp4", "fp8": "fp8"}.get(stress, "none")
        assert recipe.run.max_staleness == {"stale4": 4, "stale8": 8}.get(stress, 0)
        assert recipe.trainer.mini_batches == (4 if stress.startswith("n4") else 1)
        assert recipe.trainer.routing_replay == {"n4r2": "r2", "n4r3": "r3"}.get(stress, "off")
    check_recipes(grid, grid.configs)


@pytest.mark.parametrize(
    "text,error",
    [
        (
            '[grid]\nbase = "x.toml"\n[[config]]\nname = "a"\n[[stress]]\nname = "s"\nseeds = 2\n',
            "\\[\\[stress\\]\\] s: unknown keys \\['seeds'\\]",
        ),
        (
            '[grid]\nbase = "x.toml"\n[[config]]\nname = "a"\n[[stress]]\nname = "s t"\n',
            "\\[\\[stress\\]\\] needs a name",
        ),
        (
            '[grid]\nbase = "x.toml"\n[collapse]\nreward_below = 1\n[[config]]\nname = "a"\n',
            "unknown collapse rules \\['reward_below'\\]",
        ),
        ('[grid]\nbase = "x.toml"\n[[config]]\nname = "a"\n[[config]]\nname = "a"\n', "repeat"),
        ('[grid]\nbase = "x.toml"\n[[config]]\nname = "a b"\n', "name of letters"),
        ('[grid]\nbase = "x.toml"\nseeds = 3\n[[config]]\nname = "a"\n', "unknown \\[grid\\] keys \\['seeds'\\]"),
        (
            '[grid]\nbase = "x.toml"\neval_final_model = "fp32"\n[[config]]\nname = "a"\n',
            "eval_final_model must be one of .*'fp32'",
        ),
        (
            '[grid]\nbase = "x.toml"\n[collapse]\nfinal_model_drop = 0.1\n[[config]]\nname = "a"\n',
            "final_model_drop needs eval_final_model",
        ),
    ],
)
def test_grid_errors_name_the_problem(tmp_path, text, error):
    bad = tmp_path / "g.toml"
    bad.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_grid(bad)


def test_summarise_run_uses_the_last_tenth_and_flags_collapse():
    metrics = steps(100)
    evals = [{"version": 0, "accuracy": 0.4}, {"version": 50, "accuracy": 0.7}, {"version": 100, "accuracy": 0.5}]
    row = summarise_run(metrics, evals, {"eval_drop": 0.15, "entropy_below": 0.02})
    assert row["steps"] == 100
    assert row["reward_end"] == pytest.approx(sum(range(91, 101)) / 10 / 100)
    assert row["entropy_end"] == pytest.approx(0.5 - 0.004 * 95.5)
    assert row["is_weight_max"] == pytest.approx(2.0)
    assert (row["eval_start"], row["eval_best"], row["eval_final"]) == (0.4, 0.7, 0.5)
    assert row["collapsed"] and row["collapse_reason"] == "eval fell 0.200 from its best"
    calm = summarise_run(metrics, evals, {"eval_drop": 0.25})
    assert not calm["collapsed"] and calm["collapse_reason"] == ""


def test_entropy_and_nonfinite_losses_flag_collapse_and_resumed_steps_count_once():
    metrics = steps(20, entropy=0.01) + [{**steps(20)[-1], "loss": float("nan"), "entropy": 0.01}]
    row = summarise_run(metrics, [], {"entropy_below": 0.02})
    assert row["steps"] == 20  # step 20 logged twice (a resume): its last line counts
    assert row["nonfinite_steps"] == 1
    assert row["collapse_reason"] == "entropy 0.01 < 0.02; 1 steps with a non-finite loss"
    assert row["eval_best"] is None


def test_aggregate_means_stds_and_collapse_count():
    rows = [
        {"config": "a", "seed": s, "eval_final": v, "entropy_end": None, "collapsed": c, "collapse_reason": ""}
        for s, (v, c) in enumerate([(0.5, False), (0.6, True), (0.7, False)])
    ]
    out = aggregate(rows)
    assert out["seeds"] == 3 and out["collapsed"] == 1
    assert out["eval_final"] == pytest.approx(0.6) and out["eval_final_std"] == pytest.approx(0.1)
    assert out["entropy_end"] is None and "seed_std" not in out


def test_markdown_table_has_a_row_per_configuration():
    grid = load_grid(ROOT / "configs" / "paper-grid.toml")
    row = summarise_run(steps(10), [{"version": 0, "accuracy": 0.4}, {"version": 10, "accuracy": 0.45}], {})
    summary = {grid.configs[0].name: aggregate([{**row, "seed": 0}, {**row, "seed": 1}])}
    lines = markdown_table(grid.configs, summary).splitlines()
    assert len(lines) == 3 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 12
    assert "0.450 ± 0.000" in lines[2] and lines[2].endswith("| 0/2 |")


def test_the_final_model_eval_is_a_column_of_the_row_the_summary_and_the_table():
    grid = load_grid(ROOT / "configs" / "paper-grid.toml")
    evals = [{"version": 0, "accuracy": 0.4}, {"version": 10, "accuracy": 0.3}]
    rows = [
        {
            **summarise_run(
                steps(10),
                evals,
                {},
                [{"version": 0, "accuracy": 0.4}, {"version": 5, "accuracy": 0.9}, {"version": 10, "accuracy": a}],
            ),
            "seed": s,
        }
        for s, a in enumerate([0.5, 0.6])
    ]
    assert rows[0]["final_model_eval"] == 0.5 and rows[0]["eval_final"] == 0.3  # π's newest version beside μ
    assert rows[0]["initial_model_eval"] == 0.4
    failed = {**summarise_run(steps(3), evals, {}), "seed": 2}  # a run that left no final model
    assert "final_model_eval" not in failed
    out = aggregate([failed, *rows])  # the column is found in any row, averaged over those that have it
    assert out["final_model_eval"] == pytest.approx(0.55) and out["final_model_eval_std"] == pytest.approx(
        0.0707, abs=1e-4
    )
    lines = markdown_table(grid.configs[:1], {grid.configs[0].name: out}, "float32").splitlines()
    assert "| eval final | final model eval (float32) | reward" in lines[0]
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 13
    assert "| 0.300 ± 0.000 | 0.550 ± 0.071 |" in lines[2]


def test_final_model_drop_judges_collapse_on_the_trainers_model():
    """μ's eval (the quantized replica) may swing; the rule compares π at the end with π at the start."""
    evals = [{"version": 0, "accuracy": 0.35}, {"version": 5, "accuracy": 0.55}, {"version": 10, "accuracy": 0.30}]
    rule = {"eval_drop": 0.15, "final_model_drop": 0.1}
    fell = summarise_run(steps(10), evals, rule, [{"version": 10, "accuracy": 0.18}, {"version": 0, "accuracy": 0.445}])
    assert fell["initial_model_eval"] == 0.445 and fell["final_model_eval"] == 0.18
    assert fell["collapse_reason"] == "eval fell 0.250 from its best; final model 0.265 under the initial one"
    held = summarise_run(
        steps(10),
        evals,
        {"final_model_drop": 0.1},
        [{"version": 0, "accuracy": 0.43}, {"version": 10, "accuracy": 0.34}],
    )  # 0.09: under it
    assert not held["collapsed"]
    edge = summarise_run(
        steps(10),
        evals,
        {"final_model_drop": 0.1},
        [{"version": 0, "accuracy": 0.445}, {"version": 10, "accuracy": 0.345}],
    )
    assert 0.445 - 0.345 > 0.1 and not edge["collapsed"]  # exactly 10 points is not "more than 10"
    unscored = summarise_run(steps(10), evals, {"final_model_drop": 0.1}, [{"version": 0, "accuracy": 0.43}])
    assert not unscored["collapsed"] and "final_model_eval" not in unscored  # no checkpoint: nothing to compare


def test_policy_eval_drop_judges_collapse_on_pi_scored_live():
    """π's last live round against its first, as the run wrote them: nothing scored after the run.
    A grid whose runs do not score π live is refused before the first run starts."""
    evals = [{"version": 0, "accuracy": 0.3}]
    live = [
        {"step": 0, "version": 0, "accuracy": 0.32},
        {"step": 25, "version": 25, "accuracy": 0.05},
        {"step": 50, "version": 50, "accuracy": 0.015},
    ]
    rule = {"policy_eval_drop": 0.1}
    fell = summarise_run(steps(10), evals, rule, [], live)
    assert fell["collapsed"] and fell["collapse_reason"] == "π live 0.305 under its start"
    dipped = [*live[:2], {"step": 50, "version": 50, "accuracy": 0.3}]  # under for a round, back by the end
    assert not summarise_run(steps(10), evals, rule, [], dipped)["collapsed"]
    edge = [{"step": 0, "version": 0, "accuracy": 0.34}, {"step": 50, "version": 50, "accuracy": 0.24}]
    assert 0.34 - 0.24 > 0.1 and not summarise_run(steps(10), evals, rule, [], edge)["collapsed"]  # exactly 10 points
    assert not summarise_run(steps(10), evals, rule, [], [])["collapsed"]  # no live rounds: nothing to compare
    grid = load_grid(ROOT / "configs" / "paper-grid.toml")
    grid.collapse = rule
    with pytest.raises(ValueError, match="policy_eval_drop needs orchestrator.evals.policy"):
        check_recipes(grid, grid.configs)
    check_recipes(grid, grid.configs, ["orchestrator.evals.policy=true"])


def test_live_policy_evals_are_columns_and_a_plot(tmp_path):
    """policy-eval.jsonl (π scored live): its first, lowest and last round are columns of the row;
    the grid's plots gain π's live curve (mean over seeds, by version) when any run has one."""
    grid = load_grid(ROOT / "configs" / "paper-grid.toml")
    live = [
        {"step": 25, "version": 25, "accuracy": 0.5},
        {"step": 0, "version": 0, "accuracy": 0.42},
        {"step": 50, "version": 50, "accuracy": 0.3},
    ]
    row = summarise_run(steps(10), [{"version": 0, "accuracy": 0.4}], {}, [], live)
    assert (row["policy_eval_start"], row["policy_eval_min"], row["policy_eval_final"]) == (0.42, 0.3, 0.3)
    assert "policy_eval_start" not in summarise_run(steps(10), [{"version": 0, "accuracy": 0.4}], {})
    runs = {grid.configs[0].name: [(steps(10), [{"version": 0, "accuracy": 0.4}], [], live)]}
    written = plot_grid(tmp_path, grid.configs[:1], runs)
    assert (
        "plots/policy_eval_accuracy.png" in written and (tmp_path / "plots" / "policy_eval_accuracy.png").stat().st_size
    )
    runs[grid.configs[0].name] = [(steps(10), [{"version": 0, "accuracy": 0.4}], [], [])]
    assert "plots/policy_eval_accuracy.png" not in plot_grid(tmp_path / "none", grid.configs[:1], runs)


def test_curves():
    assert moving_mean([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    s, v = mean_curve([[{"step": 1, "k": 1.0}, {"step": 2, "k": math.nan}], [{"step": 1, "k": 3.0}]], "k")
    assert (s, v) == ([1], [2.0])


def test_plain_progress_is_one_greppable_line_per_update():
    from steadyrl.progress import plain_line, progress_rows

    rows = progress_rows(
        {"trainer_version": 12, "replica_versions": {"r": 12}},
        [{"step": 12, "reward_mean": 0.5, "mismatch_kl_k3": 3e-3, "staleness_peak": 1, "tokens_per_s": 900}],
        [{"version": 0, "accuracy": 0.4}, {"version": 10, "accuracy": 0.55}],
        48,
        6.0,
    )
    assert plain_line(rows) == (
        "progress step=12/48 trainer_version=12 reward=0.500 mismatch_KL_k3=3.00e-03 "
        "staleness_peak=1 tokens/s=900 eval_accuracy=v0:0.400,v10:0.550 ETA=18s"
    )
    rows = progress_rows({}, [], [{"version": 0, "accuracy": 0.4}], 48, 0.0, [{"version": 0, "accuracy": 0.35}])
    assert plain_line(rows).endswith(" eval_accuracy=v0:0.400 policy_eval=v0:0.350 ETA=-")


def test_an_interrupted_run_stops_the_grid(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) reaches the run in progress: it stops, and so does the grid, not just that run."""
    import steadyrl.launcher
    from steadyrl.experiment import run_grid

    started = []

    def run(recipe, run_dir, progress="none"):
        started.append(run_dir.parent.name)
        return {"outcome": "interrupted", "wall_seconds": 1.0}

    monkeypatch.setattr(steadyrl.launcher, "run", run)
    grid = load_grid(ROOT / "configs" / "arena.toml")
    with pytest.raises(KeyboardInterrupt, match="fp4-minirl seed 0"):
        run_grid(grid, 2, tmp_path, only=["fp4-minirl", "fp4-grpo"], echo=lambda line: None)
    assert started == ["fp4-minirl"]


def test_a_recorded_row_stands_for_its_run_and_the_record_grows_by_new_seeds(tmp_path, monkeypatch):
    """The committed arena results.csv as the record: seeds 0..5 are not run again, seed 6 is, and
    every recorded row (other configurations' too) is written back beside the new one, typed back."""
    import csv

    import steadyrl.experiment
    import steadyrl.launcher
    from steadyrl.experiment import recorded_rows, run_grid

    with (ROOT / "docs" / "reproduction" / "arena" / "results.csv").open(newline="") as f:
        committed = [row for row in csv.DictReader(f) if int(row["seed"]) < 6]  # the record of seeds 0-5
    with (tmp_path / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(committed[0]))
        writer.writeheader()
        writer.writerows(committed)
    before = recorded_rows(tmp_path)
    assert len(before) == len(committed) >= 120 and before[("stale4-dppo", 3)]["collapsed"] is False
    assert isinstance(before[("fp4-minirl", 0)]["final_model_eval"], float)
    started = []

    def run(recipe, run_dir, progress="none"):
        started.append((run_dir.parent.name, run_dir.name))
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text('{"outcome": "finished"}')
        return {"outcome": "finished", "wall_seconds": 1.0}

    monkeypatch.setattr(steadyrl.launcher, "run", run)
    monkeypatch.setattr(steadyrl.experiment, "model_evals", lambda run_dir, dtype, echo: [])
    grid = load_grid(ROOT / "configs" / "arena.toml")
    run_grid(grid, 7, tmp_path, only=["stale4-minirl", "stale4-dppo"], echo=lambda line: None)
    assert started == [("stale4-minirl", "seed-6"), ("stale4-dppo", "seed-6")]
    with (tmp_path / "results.csv").open(newline="") as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(committed) + 2
    after = recorded_rows(tmp_path)
    assert {k: v for k, v in after.items() if k[1] < 6} == before
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stale4-minirl"]["seeds"] == 7 and summary["stale4-minirl"]["collapsed"] == 6
    assert summary["stale4-dppo"]["collapsed"] == 0 and "fp4-minirl" not in summary


def test_a_recorded_row_that_is_no_number_is_refused_naming_its_cell(tmp_path):
    from steadyrl.experiment import recorded_rows

    (tmp_path / "results.csv").write_text(
        "config,seed,outcome,eval_final\nfp4-minirl,0,finished,0.3\nfp4-grpo,1,finished,x\n"
    )
    with pytest.raises(ValueError, match="fp4-grpo seed 1: column eval_final holds 'x', not a number"):
        recorded_rows(tmp_path)
    (tmp_path / "results.csv").write_text("config,seed,outcome,eval_final\nfp4-grpo,1,failed,x\n")
    assert recorded_rows(tmp_path) == {}  # a run that did not finish is run again, whatever its row holds
