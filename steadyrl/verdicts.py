"""The verdict on each of the paper's six findings, from the committed per-run results
(docs/reproduction/**/results.csv), by one rule (docs/REPRODUCTION.md prints what this writes).

A finding is a list of claims comparing recipes (`collapses_more`, `higher`, `never_collapses`, `no_gain`), each with
its test; it is reproduced in a setting when all its claims hold there. The score is π's final float32 accuracy
where the grid scored it, else μ's final eval. The objective arena (configs/arena.toml) is judged by the same two
tests, each objective against MiniRL under each stress (`arena_table`). `python -m steadyrl.verdicts` prints the
tables.

Details: docs/internals/cli.md"""

from __future__ import annotations

import csv
import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "docs" / "reproduction"
MARGIN = 0.05  # a gain under 5 accuracy points is no gain
PAPER_VARIANTS = ("n1-minirl-lennorm", "n1-minirl-no-is", "n1-minirl-r3")  # the paper's other on-policy recipes


@dataclass(frozen=True)
class Claim:
    kind: str  # collapses_more | higher | never_collapses | no_gain
    a: tuple[str, ...]  # configurations pooled as A (fnmatch patterns: n[48] is N = 4 or 8)
    b: tuple[str, ...] = ()  # ... and as B


@dataclass(frozen=True)
class Finding:
    key: str
    text: str
    claims: tuple[Claim, ...]


FINDINGS = (
    Finding(
        "a",
        "on-policy MiniRL is the most stable and best",
        (Claim("collapses_more", PAPER_VARIANTS, ("n1-minirl",)), Claim("higher", ("n1-minirl",), PAPER_VARIANTS)),
    ),
    Finding(
        "b",
        "without the training–inference IS weight it collapses",
        (Claim("collapses_more", ("n1-minirl-no-is",), ("n1-minirl",)),),
    ),
    Finding(
        "c",
        "length normalisation is stable but worse",
        (Claim("higher", ("n1-minirl",), ("n1-minirl-lennorm",)), Claim("never_collapses", ("n1-minirl-lennorm",))),
    ),
    Finding("d", "R3 brings no gain on-policy", (Claim("no_gain", ("n1-minirl-r3",), ("n1-minirl",)),)),
    Finding(
        "e",
        "off-policy without clipping collapses",
        (Claim("collapses_more", ("n[248]-minirl-noclip",), ("n[248]-minirl-r2", "n[248]-minirl-r3")),),
    ),
    Finding(
        "f",
        "N = 2: R2 beats R3; N ≥ 4: R3 is best",
        (
            Claim("higher", ("n2-minirl-r2",), ("n2-minirl-r3",)),
            Claim("higher", ("n[48]-minirl-r3",), ("n[48]-minirl-r2",)),
        ),
    ),
)

# (name, result files under docs/reproduction): the settings in the order they were run
SETTINGS = (
    ("bf16 inference, 150 steps, lr 2e-3 (grid v1)", ("results.csv",)),
    ("FP8 weights, mul_trace, 300 steps (grid v2)", ("v2/results.csv",)),
    ("FP8 W8A8, mul_trace, 300 steps (grid v2)", ("v2-w8a8/results.csv",)),
    ("NVFP4 W4A4, 150 steps, lr 1e-3", ("fp4-grid/results.csv",)),
    (
        "NVFP4 W4A4, 1,250 steps on policy, 600 off, lr 1e-3",
        ("fp4-long/results.csv", "fp4-long-n2/results.csv", "fp4-long-n4/results.csv"),
    ),
    ("NVFP4 W4A4, N = 8, 625 steps, lr 1e-3", ("fp4-long-n8/results.csv",)),
    (
        "NVFP4 W4A4, 300 steps, lr 2e-3, π live",
        (
            "fp4-live-pi/lr2e-3-results.csv",
            "fp4-offpolicy-lr2e-3/n2-results.csv",
            "fp4-offpolicy-lr2e-3/n4-results.csv",
        ),
    ),
)


@dataclass(frozen=True)
class Run:
    config: str
    collapsed: bool
    score: float
    score_of: str  # "π" (the trainer's model, float32) or "μ" (the served model)


def read_runs(files: tuple[str, ...], root: Path = ROOT) -> list[Run]:
    runs = []
    for name in files:
        with (root / name).open() as f:
            for row in csv.DictReader(f):
                pi = row.get("final_model_eval") or ""
                runs.append(
                    Run(row["config"], row["collapsed"] == "True", float(pi or row["eval_final"]), "π" if pi else "μ")
                )
    return runs


def fisher_greater(a_hits: int, a_n: int, b_hits: int, b_n: int) -> float:
    """One-sided Fisher exact p that A's rate is above B's: P(A has ≥ a_hits | the margins)."""
    hits = a_hits + b_hits
    total = a_n + b_n
    tail = sum(math.comb(hits, k) * math.comb(total - hits, a_n - k) for k in range(a_hits, min(a_n, hits) + 1))
    return tail / math.comb(total, a_n)


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(mean A − mean B, its standard error, Welch's t)."""

    def var(x: list[float]) -> float:
        mean = sum(x) / len(x)
        return sum((v - mean) ** 2 for v in x) / (len(x) - 1)

    diff = sum(a) / len(a) - sum(b) / len(b)
    se = math.sqrt(var(a) / len(a) + var(b) / len(b))
    return diff, se, diff / se if se else math.copysign(math.inf, diff) if diff else 0.0


def matching(runs: list[Run], patterns: tuple[str, ...]) -> list[Run]:
    return [r for r in runs if any(fnmatch.fnmatchcase(r.config, p) for p in patterns)]


def judge(claim: Claim, runs: list[Run]) -> tuple[bool, str] | None:
    """(holds, the statistic as written) for one claim; None when the setting lacks its recipes."""
    a = matching(runs, claim.a)
    b = matching(runs, claim.b)
    if not all(matching(runs, (p,)) for p in (*claim.a, *claim.b)):
        return None
    if claim.kind == "never_collapses":
        hits = sum(r.collapsed for r in a)
        return hits == 0, f"{hits}/{len(a)} collapsed"
    if claim.kind == "collapses_more":
        ha = sum(r.collapsed for r in a)
        hb = sum(r.collapsed for r in b)
        p = fisher_greater(ha, len(a), hb, len(b))
        return p < 0.05, f"collapsed {ha}/{len(a)} vs {hb}/{len(b)}, Fisher p = {p:.3g}"
    diff, se, t = welch([r.score for r in a], [r.score for r in b])
    of = a[0].score_of
    if claim.kind == "higher":
        return (
            t >= 2,
            f"{of} {diff + sum(r.score for r in b) / len(b):.3f} vs {sum(r.score for r in b) / len(b):.3f}, "
            f"t = {t:.2f}",
        )
    return diff + 2 * se < MARGIN, f"{of} gain {diff:+.3f}, + 2 SE = {diff + 2 * se:+.3f}"


def verdict(finding: Finding, runs: list[Run]) -> tuple[bool | None, list[str]]:
    """(reproduced; None when the setting cannot test it, the statistics of its claims)."""
    judged = [judge(claim, runs) for claim in finding.claims]
    if any(j is None for j in judged):
        return None, []
    return all(ok for ok, _ in judged), [text for _, text in judged]


def compared(finding: Finding, runs: list[Run]) -> list[Run]:
    """The runs of the recipes a finding compares."""
    return matching(runs, tuple(p for claim in finding.claims for p in (*claim.a, *claim.b)))


def primary(finding: Finding) -> tuple[str, tuple[str, ...]]:
    """The setting a finding is judged in: the one with the most runs of its recipes, the latest on a tie."""

    def size(setting) -> int:
        runs = read_runs(setting[1])
        if verdict(finding, runs)[0] is None:
            return -1
        return len(compared(finding, runs))

    return max(reversed(SETTINGS), key=size)


def tables() -> str:
    """The six-row verdict table and the same rule over every setting, as markdown."""
    lines = ["| finding | setting | runs | statistic | verdict |", "|---|---|---|---|---|"]
    reproduced = []
    for finding in FINDINGS:
        name, files = primary(finding)
        runs = read_runs(files)
        ok, stats = verdict(finding, runs)
        lines.append(
            f"| ({finding.key}) {finding.text} | {name} | {len(compared(finding, runs))} | "
            f"{'; '.join(stats)} | {'reproduced' if ok else 'not reproduced'} |"
        )
        reproduced += [finding.key] * bool(ok)
    lines += [
        "",
        f"**{len(reproduced)} of 6 reproduced**: {', '.join(f'({k})' for k in reproduced) or 'none'}.",
        "",
        "| setting | " + " | ".join(f"({f.key})" for f in FINDINGS) + " |",
        "|---" * (len(FINDINGS) + 1) + "|",
    ]
    for name, files in SETTINGS:
        runs = read_runs(files)
        cells = [{True: "yes", False: "no", None: "–"}[verdict(f, runs)[0]] for f in FINDINGS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --- the objective arena (configs/arena.toml): its rule, fixed before its runs ----------------------

ARENA_RESULTS = ("arena/results.csv",)  # under docs/reproduction, once runs are committed
ARENA_OBJECTIVES = ("grpo", "dppo", "gspo", "cispo")  # each judged against MiniRL under the same stress


def arena_cell(objective: str, stress: str, runs: list[Run]) -> str | None:
    """One objective against MiniRL under one stress, by the page's rule: "more stable" / "less stable"
    when one collapses more often (Fisher, one-sided p < 0.05, each direction), then "higher" / "lower"
    when π's final score differs with Welch |t| ≥ 2 (with 2 runs a side or more), else "no difference
    shown"; None without both."""
    mine, theirs = f"{stress}-{objective}", f"{stress}-minirl"
    if not (matching(runs, (mine,)) and matching(runs, (theirs,))):
        return None
    words = []
    scored = min(len(matching(runs, (mine,))), len(matching(runs, (theirs,)))) >= 2  # Welch needs 2 a side
    for kind, a, b, word in (
        ("collapses_more", theirs, mine, "more stable"),
        ("collapses_more", mine, theirs, "less stable"),
        *((("higher", mine, theirs, "higher"), ("higher", theirs, mine, "lower")) if scored else ()),
    ):
        held, _ = judge(Claim(kind, (a,), (b,)), runs)
        words += [word] * held
    return ", ".join(words) or "no difference shown"


def arena_table(runs: list[Run]) -> str:
    """Per stress: each objective's collapses and final score, and its verdict against MiniRL; and
    which reading holds there — the DPPO critique's (DPPO more stable than MiniRL), the paper's
    (MiniRL more stable than or above some objective, none more stable than it nor above it), or
    neither."""
    if not runs:
        return "No arena run is committed yet.\n"
    stresses = list(dict.fromkeys(r.config.rsplit("-", 1)[0] for r in runs))
    lines = [
        "| stress | objective | runs | collapsed | final score (mean) | against MiniRL |",
        "|---|---|---|---|---|---|",
    ]
    readings = []
    for stress in stresses:
        cells = {}
        for objective in ("minirl", *ARENA_OBJECTIVES):
            mine = matching(runs, (f"{stress}-{objective}",))
            if not mine:
                continue
            cells[objective] = arena_cell(objective, stress, runs) if objective != "minirl" else "–"
            mean = sum(r.score for r in mine) / len(mine)
            lines.append(
                f"| {stress} | {objective} | {len(mine)} | {sum(r.collapsed for r in mine)} | "
                f"{mine[0].score_of} {mean:.3f} | {cells[objective] or '–'} |"
            )
        better = [o for o, c in cells.items() if c and ("more stable" in c or "higher" in c)]
        worse = [o for o, c in cells.items() if c and ("less stable" in c or "lower" in c)]
        if "more stable" in (cells.get("dppo") or ""):
            reading = "the DPPO critique holds (DPPO more stable than MiniRL)"
        elif better:
            reading = f"neither: {', '.join(better)} better than MiniRL"
        elif worse:
            reading = f"the paper's reading holds (MiniRL better than {', '.join(worse)}, none better than it)"
        else:
            reading = "neither shown (no difference with MiniRL)"
        readings.append(f"- {stress}: {reading}.")
    return "\n".join([*lines, "", *readings]) + "\n"


def arena_tables(root: Path = ROOT) -> str:
    files = tuple(f for f in ARENA_RESULTS if (root / f).exists())
    return arena_table(read_runs(files, root) if files else [])


if __name__ == "__main__":
    print(tables(), end="")
    print()
    print(arena_tables(), end="")
