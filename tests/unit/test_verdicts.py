"""The verdict rule (steadyrl/verdicts.py): its statistics by hand, each kind of claim, and
docs/REPRODUCTION.md printing exactly what it computes from the committed results."""

from pathlib import Path

import pytest

from steadyrl.verdicts import Claim, Run, fisher_greater, judge, tables, welch

ROOT = Path(__file__).resolve().parents[2]


def test_fisher_and_welch_by_hand():
    # 4 of 6 vs 2 of 12: tables with A holding 4, 5 or 6 of the 6 hits, over C(18, 6) = 18,564
    # (C(6,4)C(12,2) + C(6,5)C(12,1) + C(6,6)C(12,0)) / 18564 = (990 + 72 + 1) / 18564
    assert fisher_greater(4, 6, 2, 12) == pytest.approx(1063 / 18564)
    assert fisher_greater(1, 1, 0, 1) == pytest.approx(0.5)
    assert fisher_greater(0, 3, 3, 3) == 1.0
    diff, se, t = welch([0.5, 0.7], [0.2, 0.4, 0.3])
    # variances 0.02 and 0.01: se = sqrt(0.02/2 + 0.01/3)
    assert diff == pytest.approx(0.3) and se == pytest.approx((0.01 + 0.01 / 3) ** 0.5)
    assert t == pytest.approx(0.3 / (0.01 + 0.01 / 3) ** 0.5)


def runs(config: str, scores: list[float], collapsed: int) -> list[Run]:
    return [Run(config, i < collapsed, s, "π") for i, s in enumerate(scores)]


def test_each_kind_of_claim():
    data = runs("x", [0.5, 0.52, 0.54, 0.5], 0) + runs("y", [0.3, 0.32, 0.34, 0.3], 3) + runs("z", [0.5, 0.56], 0)
    assert judge(Claim("higher", ("x",), ("y",)), data)[0] is True  # t = 0.2 / 0.0141 = 14
    assert judge(Claim("higher", ("y",), ("x",)), data)[0] is False
    ok, text = judge(Claim("collapses_more", ("y",), ("x",)), data)  # 3/4 vs 0/4: p = 4/70
    assert not ok and text == "collapsed 3/4 vs 0/4, Fisher p = 0.0714"
    assert judge(Claim("never_collapses", ("x",)), data) == (True, "0/4 collapsed")
    assert judge(Claim("never_collapses", ("y",)), data) == (False, "3/4 collapsed")
    # z vs x: gain +0.015, SE = sqrt(0.0018/2 + 0.000367/4) = 0.0315: 0.015 + 0.063 ≥ 0.05 — not excluded
    assert judge(Claim("no_gain", ("z",), ("x",)), data)[0] is False
    assert judge(Claim("no_gain", ("y",), ("x",)), data)[0] is True  # far below: a gain excluded
    assert judge(Claim("higher", ("x",), ("absent",)), data) is None


def test_the_reproduction_page_prints_the_rules_verdicts():
    page = (ROOT / "docs" / "REPRODUCTION.md").read_text()
    generated = tables()
    assert generated in page
    assert "**2 of 6 reproduced**: (d), (e)." in generated  # what the committed results give today


def test_the_arena_rule_on_synthetic_runs():
    """Each verdict the arena table writes, each reading of a stress, from runs made up for it."""
    from steadyrl.verdicts import arena_cell, arena_table

    stable = [0.5, 0.52, 0.54, 0.5, 0.51, 0.53]
    data = (
        runs("fp4-minirl", [0.1, 0.12, 0.1, 0.11, 0.1, 0.12], 6)  # MiniRL collapses under fp4 every time
        + runs("fp4-dppo", stable, 0)  # DPPO never: more stable (6/6 vs 0/6, p = 0.001) and higher
        + runs("fp4-gspo", [0.1, 0.12, 0.1, 0.11, 0.1, 0.12], 6)  # as MiniRL: nothing shown
        + runs("exact-minirl", stable, 0)
        + runs("exact-cispo", [0.3, 0.32, 0.3, 0.31, 0.3, 0.32], 6)  # collapses where MiniRL does not, lower
        + runs("exact-grpo", [0.5, 0.56, 0.52, 0.5, 0.53, 0.51], 0)
    )
    assert arena_cell("dppo", "fp4", data) == "more stable, higher"
    assert arena_cell("gspo", "fp4", data) == "no difference shown"
    assert arena_cell("cispo", "exact", data) == "less stable, lower"
    assert arena_cell("grpo", "exact", data) == "no difference shown"
    assert arena_cell("cispo", "fp4", data) is None  # no such runs
    table = arena_table(data)
    assert "| fp4 | dppo | 6 | 0 | π 0.517 | more stable, higher |" in table
    assert "| fp4 | minirl | 6 | 6 | π 0.108 | – |" in table
    assert "- fp4: the DPPO critique holds (DPPO more stable than MiniRL)." in table
    assert "- exact: the paper's reading holds (MiniRL better than cispo, none better than it)." in table
    higher = data + runs("stale4-minirl", [0.3] * 3 + [0.32] * 3, 0) + runs("stale4-gspo", stable, 0)
    assert "- stale4: neither: gspo better than MiniRL." in arena_table(higher)
    assert arena_table([]) == "No arena run is committed yet.\n"
    # one run a side (a pilot): the collapse test alone, no Welch on one score
    pilot = runs("fp4-minirl", [0.18], 1) + runs("fp4-dppo", [0.13], 1)
    assert arena_cell("dppo", "fp4", pilot) == "no difference shown"
    assert "- fp4: neither shown (no difference with MiniRL)." in arena_table(pilot)


def test_the_reproduction_page_prints_the_arena_rule_and_its_table():
    from steadyrl.verdicts import arena_tables

    page = (ROOT / "docs" / "REPRODUCTION.md").read_text()
    assert "## The objective arena" in page and arena_tables() in page.split("## The objective arena")[1]
