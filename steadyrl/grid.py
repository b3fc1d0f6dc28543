"""A grid of configurations (`steadyrl experiment`): its file, each run's recipe, and what is read from the runs —
a row per run (with the collapse rules), the mean ± std per configuration, the table.

A grid file (TOML) names a base recipe (`[grid] base`), overrides every run shares (`set`), the `[collapse]` rules
and the `[[config]]` entries, each a list of `--set` overrides (with `[[stress]]` entries: every stress × every
entry, `STRESS-CONFIG`). Seed s
sets `trainer.seed` and `orchestrator.data.seed`. Every run writes DIR/<config>/seed-<s>; a finished run is not run
again. With `eval_final_model` each run's final model is also scored as the trainer holds it (π): model-evals.jsonl.

Details: docs/internals/cli.md"""

from __future__ import annotations

import math
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from steadyrl.evaluation import DTYPES
from steadyrl.recipe import Recipe, load_recipe

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
    unknown = set(data) - {"grid", "collapse", "config", "stress"}
    if unknown:
        raise ValueError(f"unknown tables {sorted(unknown)} in {path}; expected grid, collapse, config, stress")
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
    configs = _entries(path, data, "config")
    if not configs:
        raise ValueError(f"{path}: no [[config]] entries")
    stresses = _entries(path, data, "stress")
    if stresses:  # the arena: every stress × every configuration
        configs = [
            GridConfig(f"{s.name}-{c.name}", f"{s.label}: {c.label}", [*s.overrides, *c.overrides])
            for s in stresses
            for c in configs
        ]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: configuration names repeat: {names}")
    return Grid(
        (path.parent / grid["base"]).resolve(), [str(s) for s in grid.get("set", [])], configs, collapse, final_dtype
    )


def _entries(path: Path, data: dict, table: str) -> list[GridConfig]:
    """The [[config]] or [[stress]] entries: a name of letters, digits, - and _, a label, overrides."""
    entries = []
    for entry in data.get(table, []):
        name = str(entry.get("name", ""))
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{path}: every [[{table}]] needs a name of letters, digits, - and _; got {name!r}")
        unknown = set(entry) - {"name", "label", "set"}
        if unknown:
            raise ValueError(f"{path}: [[{table}]] {name}: unknown keys {sorted(unknown)}; expected name, label, set")
        entries.append(GridConfig(name, str(entry.get("label", name)), [str(s) for s in entry.get("set", [])]))
    return entries


def recipe_for(grid: Grid, config: GridConfig, seed: int, extra: list[str] = ()) -> Recipe:
    """The recipe of one run: base, then the grid's overrides, the configuration's, the seed, `extra`."""
    overrides = [
        *grid.overrides,
        *config.overrides,
        f"trainer.seed={seed}",
        f"orchestrator.data.seed={seed}",
        f'run.id="{config.name}-s{seed}"',
        *extra,
    ]
    return load_recipe(grid.base, overrides)


# --- summarising (pure) ---------------------------------------------------------------------------


def _finite(values):
    return [v for v in values if isinstance(v, int | float) and math.isfinite(v)]


def summarise_run(
    metrics: list[dict],
    evals: list[dict],
    collapse: dict[str, float],
    model_evals: list[dict] = (),
    policy_evals: list[dict] = (),
) -> dict:
    """One run's row: eval accuracy (start, best, final), diagnostics and the collapse flag with its reason;
    with `model_evals` (the lines of MODEL_EVALS), the accuracies of the initial model (version 0) and
    the final one (the newest version) as the trainer holds them; with `policy_evals` (the run's
    policy-eval.jsonl: π scored live, orchestrator.evals.policy), π's first, lowest and last round."""
    by_step = {int(m["step"]): m for m in metrics}  # a resumed step keeps its last line
    series = [by_step[s] for s in sorted(by_step)]
    row: dict = {"steps": len(series)}
    tail = series[-max(1, len(series) // 10) :] if series else []
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
    drops = {
        "eval_drop": ("eval_best", "eval_final", "eval fell {:.3f} from its best"),
        "final_model_drop": ("initial_model_eval", "final_model_eval", "final model {:.3f} under the initial one"),
        "policy_eval_drop": ("policy_eval_start", "policy_eval_final", "π live {:.3f} under its start"),
    }
    for rule, (high, low, reason) in drops.items():
        if rule in collapse and row.get(high) is not None and row.get(low) is not None:
            drop = round(row[high] - row[low], 9)  # accuracies are fractions of the eval set: no float noise
            if drop > collapse[rule]:
                reasons.append(reason.format(drop))
    if (
        row["entropy_end"] is not None
        and "entropy_below" in collapse
        and row["entropy_end"] < collapse["entropy_below"]
    ):
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
    numeric = [
        k for k in columns(rows) if k not in ("collapsed", "collapse_reason", "config", "label", "seed", "outcome")
    ]
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
    head = (
        f"| configuration | eval start | eval best | eval final | {final_head}reward (last 10%) "
        "| entropy (last 10%) | mismatch KL k3 | IS weight max | clip frac | routing agreement | collapsed |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for config in configs:
        s = summary.get(config.name)
        if not s:
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    config.label,
                    _cell(s["eval_start"], s["eval_start_std"], 3),
                    _cell(s["eval_best"], s["eval_best_std"], 3),
                    _cell(s["eval_final"], s["eval_final_std"], 3),
                    *([_cell(s.get("final_model_eval"), s.get("final_model_eval_std"), 3)] if final_dtype else []),
                    _cell(s["reward_end"], s["reward_end_std"], 3),
                    _cell(s["entropy_end"], s["entropy_end_std"], 3),
                    _cell(s["mismatch_kl_mean"], s["mismatch_kl_mean_std"], 1, scientific=True),
                    _cell(s["is_weight_max"], s["is_weight_max_std"], 2),
                    _cell(s["clip_frac_mean"], s["clip_frac_mean_std"], 4),
                    _cell(s["routing_agreement_mean"], s["routing_agreement_mean_std"], 4),
                    f"{s['collapsed']}/{s['seeds']}",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"
