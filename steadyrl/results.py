"""The figures pages quote, rendered from the one results file, docs/results.json (written by
`steadyrl bench all --json docs/results.json`, each benchmark dated with its run). A page marks a
rendered figure with `<!-- results:NAME -->…<!-- /results:NAME -->`; `python -m steadyrl.reference_docs`
writes what is between the markers, and its `--check` fails when a page differs
(docs/internals/docs-site.md#figures)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("docs") / "results.json"
BLOCK = re.compile(r"(<!-- results:([a-z0-9-]+) -->)(.*?)(<!-- /results:\2 -->)", re.DOTALL)
# the pages with rendered figures (relative to the repository)
PAGES = (
    Path("README.md"),
    Path("docs/index.md"),
    Path("docs/quickstart.md"),
    Path("docs/guides/pools.md"),
    Path("docs/guides/exact.md"),
    Path("docs/weights-at-scale.md"),
)


def load(root: Path = ROOT) -> dict:
    return json.loads((root / RESULTS).read_text())


def span(values: list[float], fmt: Callable[[float], str], unit: str = "") -> str:
    """`a–b unit` over the runs, one value when they agree. Pure."""
    low, high = fmt(min(values)), fmt(max(values))
    return f"{low}{unit}" if low == high else f"{low}–{high}{unit}"


def percent(x: float) -> str:
    return f"{100 * x:.1f}"


def seconds(x: float) -> str:
    return f"{x:.0f}"


def count(x: float) -> str:
    return f"{x:,.0f}"


def share(x: float) -> str:
    return f"{x:.2f}"


def machine_text(results: dict) -> str:
    m = results["machine"]
    return f"{m['cores']} cores of {m['cpu']}, {m['memory_gib']} GiB, {'a GPU' if m['gpu'] else 'no GPU'}"


def runs_text(n: int) -> str:
    return "one run" if n == 1 else f"{n} runs, min–max"


def demo(results: dict) -> dict:
    return results["benchmarks"]["demo"]


def table(head: str, rows: list[tuple[str, str]]) -> str:
    """`head`, then a two-column markdown table of (what, measured). Pure."""
    return "\n".join([head, "", "| what | measured |", "| --- | --- |", *(f"| {a} | {b} |" for a, b in rows)])


def demo_table(results: dict) -> str:
    d = demo(results)
    runs = d["runs"]
    column = {k: [r[k] for r in runs] for k in runs[0]}
    steps = runs[0]["steps"]
    idle = f"{span(column['trainer_idle_share'], share)} / {span(column['replica_idle_share'], share)}"
    rows = [
        (
            f"greedy eval accuracy, {count(runs[0]['eval_prompts'])} held-out problems, version 0 → {steps}",
            f"{span(column['eval_start'], percent, '%')} → {span(column['eval_end'], percent, '%')} "
            f"(best {span(column['eval_best'], percent, '%')})",
        ),
        ("the whole command, from its start to its end", span(column["command_seconds"], seconds, " s")),
        (f"of it, the {steps} steps", span(column["steps_seconds"], seconds, " s")),
        ("completion tokens trained", span(column["tokens"], count)),
        ("trainer / replica idle share per step (mean)", idle),
        (
            "tasks dropped as staler than the budget",
            f"{span(column['dropped'], count)} of {count(runs[0]['submitted'])}",
        ),
        (
            "the machine's load: 1-minute average before a run / share of both cores busy during it",
            f"{span(column['load_1min_before'], share)} / {span(column['machine_busy_share'], share)}",
        ),
    ]
    head = (
        f"`{d['command']}` as it ships, measured by `steadyrl bench demo` on {machine_text(results)} "
        f"({d.get('date', results['date'])}; {runs_text(len(runs))}):"
    )
    return table(head, rows)


def demo_wall(results: dict) -> str:
    d = demo(results)
    walls = [r["command_seconds"] for r in d["runs"]]
    date = d.get("date", results["date"])
    return f"{span(walls, seconds, ' s')} ({runs_text(len(walls))}, {date}, `steadyrl bench demo`)"


def pools(results: dict) -> dict:
    return results["benchmarks"]["pools"]


def last(evals: dict) -> float:
    return evals[max(evals, key=int)]


def pools_summary(results: dict) -> str:
    p = pools(results)
    judge, distill, rl = p["judge"], p["distill"], p["rl"]
    judge_steps = max(map(int, judge["evals"]))
    return (
        f"On the demo, RL on the kit's tiny judge alone lifts the exact-match eval {judge['evals']['0']:.2f} → "
        f"{last(judge['evals']):.2f} in {judge_steps} steps, and a student distilled from the kit's tiny teacher's "
        f"top-8 distribution learns a format RL alone barely moves on: {distill['evals']['0']:.2f} → its teacher's "
        f"{p['teacher']['held_out']:.2f} by step {count(distill['steps_to_teacher'])}, RL alone at most "
        f"{max(rl['evals'].values()):.2f} in {count(p['steps'])} (`steadyrl bench pools`, {p.get('date', '')})."
    )


def exact_table(results: dict) -> str:
    x = results["benchmarks"]["exact"]
    e, t, d = x["engine"], x["trainer"], x["demo"]
    runs = d["runs"]
    rows = [
        (
            "replica tokens/s on the demo's step (256 sequences × 6 tokens, one thread), exact / normal bf16 as "
            "shipped",
            f"{e['exact_over_normal_bf16']} ({count(e['exact_tokens_per_s'])} vs "
            f"{count(e['normal_bf16_tokens_per_s'])}; rounds {span(e['exact_over_normal_bf16_spread'], share)})",
        ),
        (
            "the same, exact / normal fp32",
            f"{e['exact_over_normal_fp32']} ({count(e['exact_tokens_per_s'])} vs "
            f"{count(e['normal_fp32_tokens_per_s'])}; rounds {span(e['exact_over_normal_fp32_spread'], share)})",
        ),
        (
            f"trainer seconds per step ({t['rollouts']} rollouts one version behind, every token checked), "
            "normal / exact",
            f"{t['normal_over_exact_step_seconds']} ({t['normal_step_seconds']:.3f} vs "
            f"{t['exact_step_seconds']:.3f} s; rounds {span(t['normal_over_exact_spread'], share)})",
        ),
        (
            "the demo's 400 steps, normal / exact seconds",
            f"{d['normal_over_exact_steps_seconds']} (pairs {span(d['normal_over_exact_spread'], share)})",
        ),
        (
            "tokens compared bit for bit in the exact demo runs / tokens trained",
            f"{span([r['exact_tokens'] for r in runs['exact']], count)} / "
            f"{span([r['tokens'] for r in runs['exact']], count)}",
        ),
    ]
    for version, sides in d["eval_at_equal_steps"].items():
        rows.append(
            (
                f"greedy eval accuracy at version {version}, exact / normal",
                f"{span(sides['exact'], percent, '%')} / {span(sides['normal'], percent, '%')}",
            )
        )
    load = [r["load_1min_before"] for side in runs.values() for r in side]
    busy = [r["machine_busy_share"] for side in runs.values() for r in side]
    rows.append(
        (
            "the machine's load before a demo run / share of both cores busy",
            f"{span(load, share)} / {span(busy, share)}",
        )
    )
    head = (
        f"`steadyrl bench exact` on {machine_text(results)} ({x.get('date', results['date'])}; the demo "
        f"{runs_text(d['pairs'])} of each side, run in turn):"
    )
    return table(head, rows)


# What a version weighs in bf16 (parameters × 2 bytes), for the extrapolation on docs/weights-at-scale.md
SCALES = (("7B (dense)", 7.6e9), ("Qwen3-30B-A3B", 30.5e9), ("Qwen3-235B-A22B", 235e9))
LINK_BYTES_PER_S = 1.25e9  # a 10 Gb/s link between the trainer's host and a replica's


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"


def weights_scale(results: dict) -> str:
    """Seconds per version against the model's size: measured here (whole and patch, by shm, and by
    collective where the results hold it), then extrapolated from the largest measured size's rate and
    the measured patch share. Pure."""
    b = results["benchmarks"]
    p, ws = b["weight_patches"], b["weightsync"]
    measured = []
    for key, label in (("demo", "the demo's model (lr 1e-3)"), ("qwen3_100m", "~108M Qwen3-MoE (lr 1e-6)")):
        side = p[key]
        collective = side.get("by_transport", {}).get("collective")
        beside = (
            f"; by collective: whole {collective['refit_seconds']['whole']:.3f} s, patch "
            f"{collective['refit_seconds']['patch']:.3f} s (patch / whole {collective['refit_patch_over_whole']})"
            if collective
            else ""
        )
        measured.append(
            (
                f"{label}, {gb(side['model_bytes'])}",
                f"whole {side['refit_seconds']['whole']:.3f} s, patch {side['refit_seconds']['patch']:.3f} s "
                f"(patch / whole {side['refit_patch_over_whole']}; bytes {side['bytes_patch_over_whole']}){beside}",
            )
        )
    big = ws["refit"]["torch"]["1"]["shm"]["seconds"]
    nbytes = ws["model"]["bytes"]
    measured.append(
        (
            f"~590M Qwen3-MoE ({ws['model']['layers']} layers), {gb(nbytes)}",
            f"whole {big:.2f} s (`bench weightsync`, {ws.get('date', '')})",
        )
    )
    rate = nbytes / big
    patch_share = p["qwen3_100m"]["bytes_patch_over_whole"]
    slower = p["qwen3_100m"]["refit_patch_over_whole"]
    transports = "shm and collective (gloo)" if "by_transport" in p["qwen3_100m"] else "shm"
    head = (
        f"Measured on {machine_text(results)} (`steadyrl bench weight_patches`, {p.get('date', '')}; one trainer, "
        f"one torch replica, {transports}, one thread each; median of 9 interleaved pairs):"
    )
    rows = [*measured]
    for name, params in SCALES:
        version = 2 * params
        rows.append(
            (
                f"{name}, {gb(version)} (extrapolated)",
                f"this path: whole {version / rate:,.0f} s, patch ≈ {slower * version / rate:,.0f} s; its bytes "
                f"alone over a 10 Gb/s link: whole {version / LINK_BYTES_PER_S:,.0f} s, "
                f"patch {patch_share * version / LINK_BYTES_PER_S:,.1f} s",
            )
        )
    return table(head, rows)


RENDERERS: dict[str, Callable[[dict], str]] = {
    "weights-scale": weights_scale,
    "exact-table": exact_table,
    "demo-table": demo_table,
    "demo-wall": demo_wall,
    "pools-summary": pools_summary,
}


def render(text: str, results: dict) -> str:
    """`text` with every block's inside written anew from `results`; an unknown block name is an error."""

    def one(match: re.Match) -> str:
        name = match.group(2)
        if name not in RENDERERS:
            raise KeyError(f"unknown results block {name!r}; one of {sorted(RENDERERS)}")
        inside = RENDERERS[name](results)
        multiline = "\n" in match.group(3)
        inside = f"\n{inside}\n" if multiline or "\n" in inside else inside
        return match.group(1) + inside + match.group(4)

    return BLOCK.sub(one, text)


def rendered_pages(root: Path = ROOT) -> dict[Path, str]:
    """Each page with rendered figures (relative path) and its text as the results make it."""
    results = load(root)
    return {page: render((root / page).read_text(), results) for page in PAGES}
