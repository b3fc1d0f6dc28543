"""The grid's plots: one PNG per diagnostic with a line per configuration (mean over its seeds)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from steadyrl.grid import CURVES, GridConfig


def moving_mean(values: list[float], window: int) -> list[float]:
    out = []
    total = 0.0
    queue = []
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


def plot_grid(
    out: Path,
    configs: list[GridConfig],
    runs: dict[str, list[tuple[list[dict], list[dict], list[dict], list[dict]]]],
    final_dtype: str = "",
) -> list[str]:
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
        accuracy_plots.append(
            (
                2,
                "model_eval_accuracy",
                f"greedy eval accuracy of the trainer's model in {final_dtype} (mean over seeds)",
            )
        )
    if any(run[3] for config_runs in runs.values() for run in config_runs):
        accuracy_plots.append(
            (3, "policy_eval_accuracy", "greedy eval accuracy of the trainer's model, scored live (mean over seeds)")
        )
    for column, name, title in accuracy_plots:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for index, config in enumerate(configs):
            by_version: dict[int, list[float]] = {}
            for run in runs.get(config.name, []):
                for e in run[column]:
                    by_version.setdefault(int(e["version"]), []).append(float(e["accuracy"]))
            if by_version:
                versions = sorted(by_version)
                ax.plot(
                    versions,
                    [statistics.fmean(by_version[v]) for v in versions],
                    marker="o",
                    markersize=3,
                    linewidth=1.1,
                    label=config.label,
                    **line_style(index),
                )
        ax.set_xlabel("policy version")
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plots / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(f"plots/{name}.png")
    return written
