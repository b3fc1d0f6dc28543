"""`steadyrl experiment GRID --seeds K --out DIR`: every (configuration, seed) of a grid as a whole
run, then one table, one CSV and one set of plots (the grid file and what is read from the runs:
steadyrl/grid.py; the plots: steadyrl/grid_plots.py). A finished run is not run again, so an
interrupted grid resumes; a row of `results.csv` stands for its run when the run's folder is gone
(a committed record grows by new seeds without the old runs on disk). `--report-only` writes the
report from what is there.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from steadyrl.grid import (
    MODEL_EVALS,
    Grid,
    GridConfig,
    aggregate,
    columns,
    markdown_table,
    recipe_for,
    summarise_run,
)
from steadyrl.grid_plots import plot_grid

# --- running --------------------------------------------------------------------------------------


def read_run(run_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """A run's metrics.jsonl, eval.jsonl and policy-eval.jsonl (each [] when absent)."""
    from shared.runtime.jsonl import read_jsonl

    return tuple(read_jsonl(run_dir / name) for name in ("metrics.jsonl", "eval.jsonl", "policy-eval.jsonl"))


def model_evals(run_dir: Path, dtype: str, echo=print) -> list[dict]:
    """MODEL_EVALS of a finished run, by version: the model it started from (version 0) and each
    checkpoint it kept, scored greedily in `dtype` on the run's own eval set (each version once)."""
    import tempfile

    from shared.runtime.jsonl import read_jsonl
    from steadyrl.evaluation import evaluate
    from steadyrl.report import export_checkpoint

    path = run_dir / MODEL_EVALS
    scored = {int(e["version"]): e for e in read_jsonl(path)}
    base = json.loads((run_dir / "summary.json").read_text())["model"]
    sources = {0: None} | {
        int(json.loads((step / "state.json").read_text())["version"]): step
        for step in (run_dir / "trainer" / "checkpoints").glob("step-*")
        if (step / "state.json").exists()
    }
    for version in sorted(set(sources) - set(scored)):
        with tempfile.TemporaryDirectory() as tmp:
            model = export_checkpoint(base, sources[version], Path(tmp) / "model", dtype) if version else Path(base)
            report = evaluate(str(model), [run_dir / "config.resolved.toml"], samples=0, dtype=dtype, device="auto")
        scored[version] = {
            "version": version,
            "accuracy": report["accuracy"],
            "prompts": report["prompts"],
            "dtype": dtype,
            "model": str(sources[version] or base),
        }
        with path.open("a") as f:
            f.write(json.dumps(scored[version]) + "\n")
        echo(f"{run_dir}: version {version} in {dtype}: eval {report['accuracy']}")
    return [scored[v] for v in sorted(scored)]


def recorded_rows(out: Path) -> dict[tuple[str, int], dict]:
    """The finished runs' rows of `out/results.csv`, by (configuration, seed), typed back from text
    (empty → None; numbers, booleans): what a run whose folder is gone still counts as."""
    path = out / "results.csv"
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        rows = [dict(row) for row in csv.DictReader(f)]
    recorded = {}
    for row in rows:
        if row.get("outcome") != "finished":
            continue
        for key, text in row.items():
            if key in ("config", "label", "outcome", "collapse_reason"):
                continue
            if text in ("", None):
                row[key] = None
            elif text in ("True", "False"):
                row[key] = text == "True"
            else:
                try:
                    number = float(text)
                except ValueError:
                    raise ValueError(
                        f"{path}: {row.get('config')} seed {row.get('seed')}: column {key} holds {text!r}, not a number"
                    ) from None
                row[key] = int(number) if key in ("seed", "steps", "nonfinite_steps") else number
        recorded[(row["config"], row["seed"])] = row
    return recorded


def check_recipes(grid: Grid, configs: list[GridConfig], extra: list[str] = ()) -> None:
    """Every configuration's recipe valid, and what the collapse rules read produced, before the first run starts."""
    for config in configs:
        recipe = recipe_for(grid, config, 0, extra)
        if "policy_eval_drop" in grid.collapse and not recipe.section("orchestrator").get("evals", {}).get("policy"):
            raise ValueError(
                f"configuration {config.name}: the collapse rule policy_eval_drop needs "
                "orchestrator.evals.policy = true (π scored live)"
            )


def run_grid(grid: Grid, seeds: int, out: Path, only: list[str] = (), extra: list[str] = (), echo=print) -> dict:
    """Run every (configuration, seed) not finished yet, then write results.csv, table.md, plots."""
    from steadyrl.launcher import run

    configs = [c for c in grid.configs if not only or c.name in only]
    missing = set(only) - {c.name for c in grid.configs}
    if missing:
        raise ValueError(f"unknown configurations {sorted(missing)}; the grid has {[c.name for c in grid.configs]}")
    out.mkdir(parents=True, exist_ok=True)
    check_recipes(grid, configs, extra)
    recorded = recorded_rows(out)
    for seed in range(seeds):  # seed-major: a grid cut short still compares every configuration
        for config in configs:
            run_dir = out / config.name / f"seed-{seed}"
            summary_path = run_dir / "summary.json"
            if summary_path.exists() and json.loads(summary_path.read_text()).get("outcome") == "finished":
                echo(f"{config.name} seed {seed}: finished before, kept")
                continue
            if not run_dir.exists() and (config.name, seed) in recorded:
                echo(f"{config.name} seed {seed}: recorded in results.csv, kept")
                continue
            if run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)  # a run cut short starts again from nothing
            summary = run(recipe_for(grid, config, seed, extra), run_dir, progress="none")
            echo(
                f"{config.name} seed {seed}: {summary.get('outcome')} in {summary.get('wall_seconds')} s, "
                f"eval {summary.get('eval_start')} → {summary.get('eval_end')}"
            )
            if summary.get("outcome") == "interrupted":  # Ctrl-C or SIGTERM stops the grid, not one run of it
                raise KeyboardInterrupt(
                    f"the grid was interrupted at {config.name} seed {seed}; run it again to resume"
                )
    return write_report(grid, configs, seeds, out, echo)


def write_report(grid: Grid, configs: list[GridConfig], seeds: int, out: Path, echo=print) -> dict:
    """The table, CSV and plots of the runs in `out` (scoring the final models not scored yet)."""
    rows = []
    runs = {}
    summary = {}
    recorded = recorded_rows(out)
    for config in configs:
        config_rows = []
        for seed in range(seeds):
            run_dir = out / config.name / f"seed-{seed}"
            if not run_dir.exists() and (config.name, seed) in recorded:
                rows.append(recorded[(config.name, seed)])  # its row stands; its curves are gone
                config_rows.append(recorded[(config.name, seed)])
                continue
            if not (run_dir / "summary.json").exists():
                continue
            outcome = json.loads((run_dir / "summary.json").read_text()).get("outcome")
            metrics, evals, live = read_run(run_dir)
            pi = (
                model_evals(run_dir, grid.eval_final_model, echo)
                if grid.eval_final_model and outcome == "finished"
                else []
            )
            runs.setdefault(config.name, []).append((metrics, evals, pi, live))
            row = {
                "config": config.name,
                "label": config.label,
                "seed": seed,
                "outcome": outcome,
                **summarise_run(metrics, evals, grid.collapse, pi, live),
            }
            rows.append(row)
            config_rows.append(row)
        if config_rows:
            summary[config.name] = aggregate(config_rows)
    written = {(r["config"], r["seed"]) for r in rows}
    rows += [r for key, r in recorded.items() if key not in written]  # other configurations' record stays
    if rows:
        with (out / "results.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns(rows))
            writer.writeheader()
            writer.writerows(rows)
    (out / "table.md").write_text(markdown_table(configs, summary, grid.eval_final_model))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plots = plot_grid(out, configs, runs, grid.eval_final_model) if runs else []
    return {
        "runs": len(rows),
        "configs": len(summary),
        "table": str(out / "table.md"),
        "csv": str(out / "results.csv"),
        "plots": plots,
    }
