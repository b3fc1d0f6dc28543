"""`steadyrl experiment GRID --seeds K --out DIR`: a grid of whole runs, then one table and one set of plots.

A grid file (TOML) names a base recipe, overrides shared by every run, the collapse rule and the
configurations, each a list of `--set` overrides:

```toml
[grid]
base = "tiny-arith.toml"                 # relative to the grid file
set = ["run.steps=150", "trainer.recipe=manual"]
eval_final_model = "float32"             # optional: each run's final model scored in this dtype too

[collapse]                               # a run is flagged when any rule holds
eval_drop = 0.15                         # best eval accuracy − final eval accuracy
entropy_below = 0.02                     # mean entropy of the last tenth of steps
final_model_drop = 0.1                   # needs eval_final_model: the initial model's eval − the final's
policy_eval_drop = 0.1                   # needs orchestrator.policy_eval: π's first live round − its last

[[config]]
name = "onpolicy-minirl"
label = "on-policy N=1: MiniRL"
set = ["trainer.mini_batches=1"]
```

Seed s sets `trainer.seed` and `orchestrator.task_seed` (the order of the prompts); sampling on the
replicas is not seeded, so two runs of one seed differ too. Every run writes its own directory
(DIR/<config>/seed-<s>) and a finished run is not run again, so an interrupted grid resumes.

The run's own eval scores the model its replicas serve (μ: the inference dtype and quantization).
With `eval_final_model`, each finished run's final model is also scored as the trainer holds it
(π, in that dtype, unquantized: `steadyrl eval`, greedy, on the run's eval set), and so are the model
it started from and every checkpoint the run kept (`trainer.keep_checkpoints`): model-evals.jsonl,
one line per policy version. The table gets a column for the final one, the plots a π curve.
`--report-only` scores what is not scored yet. Under a coarse inference quantization μ's eval swings
between rounds, so `final_model_drop` judges a collapse on π instead. A run with
`orchestrator.policy_eval` also scored π live at every eval round (policy-eval.jsonl, the published
weights unquantised): the rows get its first, lowest and last round, the plots its curve, and
`policy_eval_drop` judges a collapse on π without scoring anything after the run (on 40 NVFP4 runs it
disagreed with `final_model_drop` on 2, each within a point of the line).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from steadyrl.evaluation import DTYPES
from steadyrl.run_config import RunConfig, load_run_config

COLLAPSE_RULES = ("eval_drop", "entropy_below", "final_model_drop", "policy_eval_drop")

# per-step diagnostics summarised per run: (metrics key, how, column)
RUN_COLUMNS = [
    ("reward_mean", "last_tenth", "reward_end"),
    ("entropy", "last_tenth", "entropy_end"),
    ("mismatch_kl_k3", "mean", "mismatch_kl_mean"),
    ("is_weight_max", "max", "is_weight_max"),
    ("is_weight_mean", "mean", "is_weight_mean"),
    ("clip_frac", "mean", "clip_frac_mean"),
    ("routing_agreement", "mean", "routing_agreement_mean"),
    ("grad_norm", "max", "grad_norm_max"),
]
CURVES = [
    ("reward_mean", "reward (moving mean of 10 steps)", False),
    ("entropy", "entropy", False),
    ("mismatch_kl_k3", "training–inference mismatch KL (k3)", True),
    ("is_weight_mean", "IS weight mean", False),
    ("clip_frac", "clip fraction", False),
    ("routing_agreement", "routing agreement (π_old recompute vs rollout)", False),
]
MODEL_EVALS = "model-evals.jsonl"  # π by policy version: the initial model, then each kept checkpoint


@dataclass
class GridConfig:
    name: str
    label: str
    overrides: list[str]


@dataclass
class Grid:
    base: Path
    overrides: list[str]
    configs: list[GridConfig]
    collapse: dict[str, float] = field(default_factory=dict)
    eval_final_model: str = ""  # dtype each final model is scored in by the report ("": not scored)


def load_grid(path: str | Path) -> Grid:
    path = Path(path)
    data = tomllib.loads(path.read_text())
    unknown = set(data) - {"grid", "collapse", "config"}
    if unknown:
        raise ValueError(f"unknown tables {sorted(unknown)} in {path}; expected grid, collapse, config")
    grid = data.get("grid", {})
    unknown = set(grid) - {"base", "set", "eval_final_model"}
    if unknown:
        raise ValueError(f"{path}: unknown [grid] keys {sorted(unknown)}; expected base, set, eval_final_model")
    final_dtype = str(grid.get("eval_final_model", ""))
    if final_dtype not in ("", *DTYPES):
        raise ValueError(f"{path}: eval_final_model must be one of {DTYPES}, got {final_dtype!r}")
    if "base" not in grid:
        raise ValueError(f"{path}: [grid] needs base = the recipe every configuration starts from")
    collapse = dict(data.get("collapse", {}))
    bad = set(collapse) - set(COLLAPSE_RULES)
    if bad:
        raise ValueError(f"{path}: unknown collapse rules {sorted(bad)}; expected {', '.join(COLLAPSE_RULES)}")
    if "final_model_drop" in collapse and not final_dtype:
        raise ValueError(f"{path}: the collapse rule final_model_drop needs eval_final_model in [grid]")
    configs = []
    for entry in data.get("config", []):
        name = str(entry.get("name", ""))
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{path}: every [[config]] needs a name of letters, digits, - and _; got {name!r}")
        configs.append(GridConfig(name, str(entry.get("label", name)), [str(s) for s in entry.get("set", [])]))
    if not configs:
        raise ValueError(f"{path}: no [[config]] entries")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: configuration names repeat: {names}")
    return Grid((path.parent / grid["base"]).resolve(), [str(s) for s in grid.get("set", [])], configs, collapse,
                final_dtype)


def run_config_for(grid: Grid, config: GridConfig, seed: int, extra: list[str] = ()) -> RunConfig:
    """The recipe of one run: base, then the grid's overrides, the configuration's, the seed, `extra`."""
    overrides = [*grid.overrides, *config.overrides, f"trainer.seed={seed}", f"orchestrator.task_seed={seed}",
                 f'run.id="{config.name}-s{seed}"', *extra]
    return load_run_config(grid.base, overrides)


# --- summarising (pure) ---------------------------------------------------------------------------

def _finite(values):
    return [v for v in values if isinstance(v, int | float) and math.isfinite(v)]


def summarise_run(metrics: list[dict], evals: list[dict], collapse: dict[str, float],
                  model_evals: list[dict] = (), policy_evals: list[dict] = ()) -> dict:
    """One run's row: eval accuracy (start, best, final), diagnostics and the collapse flag with its reason;
    with `model_evals` (the lines of MODEL_EVALS), the accuracies of the initial model (version 0) and
    the final one (the newest version) as the trainer holds them; with `policy_evals` (the run's
    policy-eval.jsonl: π scored live, orchestrator.policy_eval), π's first, lowest and last round."""
    by_step = {int(m["step"]): m for m in metrics}  # a resumed step keeps its last line
    series = [by_step[s] for s in sorted(by_step)]
    row: dict = {"steps": len(series)}
    tail = series[-max(1, len(series) // 10):] if series else []
    for key, how, column in RUN_COLUMNS:
        values = _finite(m.get(key) for m in (tail if how == "last_tenth" else series))
        if not values:
            row[column] = None
        elif how == "max":
            row[column] = max(values)
        else:
            row[column] = statistics.fmean(values)
    row["nonfinite_steps"] = sum(1 for m in series if not _finite([m.get("loss")]))
    accuracies = [float(e["accuracy"]) for e in sorted(evals, key=lambda e: e["version"])]
    row["eval_start"] = accuracies[0] if accuracies else None
    row["eval_best"] = max(accuracies) if accuracies else None
    row["eval_final"] = accuracies[-1] if accuracies else None
    live = [float(e["accuracy"]) for e in sorted(policy_evals, key=lambda e: e["step"])]
    if live:
        row.update(policy_eval_start=live[0], policy_eval_min=min(live), policy_eval_final=live[-1])
    by_version = {int(e["version"]): float(e["accuracy"]) for e in model_evals}
    if 0 in by_version:
        row["initial_model_eval"] = by_version[0]
    if newest := max(by_version, default=0):
        row["final_model_eval"] = by_version[newest]
    reasons = []
    drops = {"eval_drop": ("eval_best", "eval_final", "eval fell {:.3f} from its best"),
             "final_model_drop": ("initial_model_eval", "final_model_eval", "final model {:.3f} under the initial one"),
             "policy_eval_drop": ("policy_eval_start", "policy_eval_final", "π live {:.3f} under its start")}
    for rule, (high, low, reason) in drops.items():
        if rule in collapse and row.get(high) is not None and row.get(low) is not None:
            drop = round(row[high] - row[low], 9)  # accuracies are fractions of the eval set: no float noise
            if drop > collapse[rule]:
                reasons.append(reason.format(drop))
    if row["entropy_end"] is not None and "entropy_below" in collapse and row["entropy_end"] < collapse["entropy_below"]:
        reasons.append(f"entropy {row['entropy_end']:.3g} < {collapse['entropy_below']}")
    if row["nonfinite_steps"]:
        reasons.append(f"{row['nonfinite_steps']} steps with a non-finite loss")
    row["collapsed"] = bool(reasons)
    row["collapse_reason"] = "; ".join(reasons)
    return row


def columns(rows: list[dict]) -> list[str]:
    """Every key of the rows, in first-seen order (a failed run has no final model eval)."""
    return list(dict.fromkeys(k for r in rows for k in r))


def aggregate(rows: list[dict]) -> dict:
    """Mean and sample standard deviation over seeds of every numeric column; collapsed runs counted."""
    out: dict = {"seeds": len(rows), "collapsed": sum(1 for r in rows if r.get("collapsed"))}
    numeric = [k for k in columns(rows) if k not in ("collapsed", "collapse_reason", "config", "label", "seed", "outcome")]
    for key in numeric:
        values = _finite(r.get(key) for r in rows)
        out[key] = statistics.fmean(values) if values else None
        out[key + "_std"] = statistics.stdev(values) if len(values) > 1 else None
    return out


def _cell(mean, std, digits: int, scientific: bool = False) -> str:
    if mean is None:
        return "–"
    text = f"{mean:.{digits}e}" if scientific else f"{mean:.{digits}f}"
    if std is None:
        return text
    return text + " ± " + (f"{std:.{digits}e}" if scientific else f"{std:.{digits}f}")


def markdown_table(configs: list[GridConfig], summary: dict[str, dict], final_dtype: str = "") -> str:
    """With `final_dtype`, a column of the final model's eval in that dtype after the run's own final eval."""
    final_head = f"final model eval ({final_dtype}) | " if final_dtype else ""
    head = (f"| configuration | eval start | eval best | eval final | {final_head}reward (last 10%) "
            "| entropy (last 10%) | mismatch KL k3 | IS weight max | clip frac | routing agreement | collapsed |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for config in configs:
        s = summary.get(config.name)
        if not s:
            continue
        lines.append("| " + " | ".join([
            config.label,
            _cell(s["eval_start"], s["eval_start_std"], 3), _cell(s["eval_best"], s["eval_best_std"], 3),
            _cell(s["eval_final"], s["eval_final_std"], 3),
            *([_cell(s.get("final_model_eval"), s.get("final_model_eval_std"), 3)] if final_dtype else []),
            _cell(s["reward_end"], s["reward_end_std"], 3),
            _cell(s["entropy_end"], s["entropy_end_std"], 3),
            _cell(s["mismatch_kl_mean"], s["mismatch_kl_mean_std"], 1, scientific=True),
            _cell(s["is_weight_max"], s["is_weight_max_std"], 2), _cell(s["clip_frac_mean"], s["clip_frac_mean_std"], 4),
            _cell(s["routing_agreement_mean"], s["routing_agreement_mean_std"], 4),
            f"{s['collapsed']}/{s['seeds']}",
        ]) + " |")
    return "\n".join(lines) + "\n"


def moving_mean(values: list[float], window: int) -> list[float]:
    out, total, queue = [], 0.0, []
    for v in values:
        queue.append(v)
        total += v
        if len(queue) > window:
            total -= queue.pop(0)
        out.append(total / len(queue))
    return out


def mean_curve(runs: list[list[dict]], key: str) -> tuple[list[int], list[float]]:
    """Per step, the mean over the runs that have a finite value of `key` there."""
    by_step: dict[int, list[float]] = {}
    for metrics in runs:
        for m in {int(m["step"]): m for m in metrics}.values():
            value = m.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                by_step.setdefault(int(m["step"]), []).append(float(value))
    steps = sorted(by_step)
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def line_style(index: int) -> dict:
    """Ten colours, then the same colours dashed, dotted…: every configuration its own line."""
    return {"color": f"C{index % 10}", "linestyle": ["-", "--", ":", "-."][index // 10 % 4]}


def plot_grid(out: Path, configs: list[GridConfig],
              runs: dict[str, list[tuple[list[dict], list[dict], list[dict], list[dict]]]],
              final_dtype: str = "") -> list[str]:
    """One PNG per diagnostic with a line per configuration (mean over its seeds); `runs` holds each
    run's (metrics, evals, model evals, policy evals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    for key, title, log in CURVES:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        drawn = False
        for index, config in enumerate(configs):
            steps, values = mean_curve([run[0] for run in runs.get(config.name, [])], key)
            if not steps:
                continue
            if key == "reward_mean":
                values = moving_mean(values, 10)
            ax.plot(steps, values, linewidth=1.1, label=config.label, **line_style(index))
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xlabel("step")
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plots / f"{key}.png", dpi=100)
        plt.close(fig)
        written.append(f"plots/{key}.png")
    accuracy_plots = [(1, "eval_accuracy", "greedy eval accuracy (mean over seeds)")]
    if final_dtype:
        accuracy_plots.append((2, "model_eval_accuracy",
                               f"greedy eval accuracy of the trainer's model in {final_dtype} (mean over seeds)"))
    if any(run[3] for config_runs in runs.values() for run in config_runs):
        accuracy_plots.append((3, "policy_eval_accuracy",
                               "greedy eval accuracy of the trainer's model, scored live (mean over seeds)"))
    for column, name, title in accuracy_plots:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for index, config in enumerate(configs):
            by_version: dict[int, list[float]] = {}
            for run in runs.get(config.name, []):
                for e in run[column]:
                    by_version.setdefault(int(e["version"]), []).append(float(e["accuracy"]))
            if by_version:
                versions = sorted(by_version)
                ax.plot(versions, [statistics.fmean(by_version[v]) for v in versions], marker="o", markersize=3,
                        linewidth=1.1, label=config.label, **line_style(index))
        ax.set_xlabel("policy version")
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plots / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(f"plots/{name}.png")
    return written


# --- running --------------------------------------------------------------------------------------

def read_run(run_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """A run's metrics.jsonl, eval.jsonl and policy-eval.jsonl (each [] when absent)."""
    from shared.jsonl import read_jsonl

    return tuple(read_jsonl(run_dir / name) for name in ("metrics.jsonl", "eval.jsonl", "policy-eval.jsonl"))


def model_evals(run_dir: Path, dtype: str, echo=print) -> list[dict]:
    """MODEL_EVALS of a finished run, by version: the model it started from (version 0) and each
    checkpoint it kept, scored greedily in `dtype` on the run's own eval set (each version once)."""
    import tempfile

    from shared.jsonl import read_jsonl
    from steadyrl.evaluation import evaluate
    from steadyrl.report import export_checkpoint

    path = run_dir / MODEL_EVALS
    scored = {int(e["version"]): e for e in read_jsonl(path)}
    base = json.loads((run_dir / "summary.json").read_text())["model"]
    sources = {0: None} | {int(json.loads((step / "state.json").read_text())["version"]): step
                           for step in (run_dir / "trainer" / "checkpoints").glob("step-*")
                           if (step / "state.json").exists()}
    for version in sorted(set(sources) - set(scored)):
        with tempfile.TemporaryDirectory() as tmp:
            model = (export_checkpoint(base, sources[version], Path(tmp) / "model", dtype) if version
                     else Path(base))
            report = evaluate(str(model), [run_dir / "config.resolved.toml"], samples=0, dtype=dtype, device="auto")
        scored[version] = {"version": version, "accuracy": report["accuracy"], "prompts": report["prompts"],
                           "dtype": dtype, "model": str(sources[version] or base)}
        with path.open("a") as f:
            f.write(json.dumps(scored[version]) + "\n")
        echo(f"{run_dir}: version {version} in {dtype}: eval {report['accuracy']}")
    return [scored[v] for v in sorted(scored)]


def check_recipes(grid: Grid, configs: list[GridConfig], extra: list[str] = ()) -> None:
    """Every configuration's recipe valid, and what the collapse rules read produced, before the first run starts."""
    for config in configs:
        recipe = run_config_for(grid, config, 0, extra)
        if "policy_eval_drop" in grid.collapse and not recipe.section("orchestrator").get("policy_eval"):
            raise ValueError(f"configuration {config.name}: the collapse rule policy_eval_drop needs "
                             "orchestrator.policy_eval = true (π scored live)")


def run_grid(grid: Grid, seeds: int, out: Path, only: list[str] = (), extra: list[str] = (),
             echo=print) -> dict:
    """Run every (configuration, seed) not finished yet, then write results.csv, table.md, plots."""
    from steadyrl.launcher import run

    configs = [c for c in grid.configs if not only or c.name in only]
    missing = set(only) - {c.name for c in grid.configs}
    if missing:
        raise ValueError(f"unknown configurations {sorted(missing)}; the grid has {[c.name for c in grid.configs]}")
    out.mkdir(parents=True, exist_ok=True)
    check_recipes(grid, configs, extra)
    for seed in range(seeds):  # seed-major: a grid cut short still compares every configuration
        for config in configs:
            run_dir = out / config.name / f"seed-{seed}"
            summary_path = run_dir / "summary.json"
            if summary_path.exists() and json.loads(summary_path.read_text()).get("outcome") == "finished":
                echo(f"{config.name} seed {seed}: finished before, kept")
                continue
            if run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)  # a run cut short starts again from nothing
            summary = run(run_config_for(grid, config, seed, extra), run_dir, progress="none")
            echo(f"{config.name} seed {seed}: {summary.get('outcome')} in {summary.get('wall_seconds')} s, "
                 f"eval {summary.get('eval_start')} → {summary.get('eval_end')}")
    return write_report(grid, configs, seeds, out, echo)


def write_report(grid: Grid, configs: list[GridConfig], seeds: int, out: Path, echo=print) -> dict:
    """The table, CSV and plots of the runs in `out` (scoring the final models not scored yet)."""
    rows, runs, summary = [], {}, {}
    for config in configs:
        config_rows = []
        for seed in range(seeds):
            run_dir = out / config.name / f"seed-{seed}"
            if not (run_dir / "summary.json").exists():
                continue
            outcome = json.loads((run_dir / "summary.json").read_text()).get("outcome")
            metrics, evals, live = read_run(run_dir)
            pi = model_evals(run_dir, grid.eval_final_model, echo) if grid.eval_final_model and outcome == "finished" else []
            runs.setdefault(config.name, []).append((metrics, evals, pi, live))
            row = {"config": config.name, "label": config.label, "seed": seed, "outcome": outcome,
                   **summarise_run(metrics, evals, grid.collapse, pi, live)}
            rows.append(row)
            config_rows.append(row)
        if config_rows:
            summary[config.name] = aggregate(config_rows)
    if rows:
        with (out / "results.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns(rows))
            writer.writeheader()
            writer.writerows(rows)
    (out / "table.md").write_text(markdown_table(configs, summary, grid.eval_final_model))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plots = plot_grid(out, configs, runs, grid.eval_final_model) if runs else []
    return {"runs": len(rows), "configs": len(summary), "table": str(out / "table.md"),
            "csv": str(out / "results.csv"), "plots": plots}
