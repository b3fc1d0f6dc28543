"""Every figure a page quotes comes from the results its command wrote (docs/internals/docs-site.md#figures):
the demo's and the benchmarks' from docs/results.json, rendered into the pages' `results:` blocks;
REPRODUCTION.md's from the experiment records under docs/reproduction/. A figure is a number with a
unit of time, a percentage, a ratio (×), a rate, a transition (`a → b`) or a bold decimal; outside a
block, code or a generated page it must be found in the page's source, or be one of the values below
that no run measured (a setting's default, a limit, a test's parameter, a plan's arithmetic)."""

import json
import re
from pathlib import Path

import pytest

from steadyrl import results

ROOT = Path(__file__).resolve().parents[2]
FIGURE = re.compile(
    r"(?<![\w.])(?:\d[\d,]*(?:\.\d+)?\s?(?:%|ms\b|µs\b|s\b|min\b|minutes?\b|×|tokens/s|GiB/s|MB/s|GB/s)"
    r"|\d[\d,]*(?:\.\d+)?\s?→\s?\d[\d,]*(?:\.\d+)?|\*\*[+−-]?\d+\.\d+\*\*)"
)
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
GENERATED = ("docs/reference/", "docs/reproduction/", "docs/BENCHMARKS.md")


def source_numbers(results_data: dict, pointer: str) -> set[float]:
    node = results_data
    for part in pointer.split("."):
        node = node[part]
    return {float(n.replace(",", "")) for n in NUMBER.findall(json.dumps(node))}


def record_numbers() -> set[float]:
    found = set()
    for path in (ROOT / "docs" / "reproduction").rglob("*"):
        if path.suffix in (".csv", ".md", ".json", ".jsonl", ".toml"):
            found |= {float(n.replace(",", "")) for n in NUMBER.findall(path.read_text())}
    return found


def file_numbers(path: Path) -> set[float]:
    return {float(n.replace(",", "")) for n in NUMBER.findall(path.read_text())}


def log_numbers() -> set[float]:
    return {
        float(n.replace(",", ""))
        for path in (ROOT / "docs" / "gpu").glob("*.log")
        for n in NUMBER.findall(path.read_text())
    }


# page → where its figures outside blocks come from
SOURCES = {
    # the experiment records, its section on each inference precision's mismatch (`steadyrl bench mismatch`),
    # and the committed log of the one GPU run it quotes (`scripts/gpu-check`)
    "docs/REPRODUCTION.md": lambda: (
        record_numbers() | source_numbers(results.load(), "benchmarks.mismatch") | log_numbers()
    ),
    "docs/guides/pools.md": lambda: source_numbers(results.load(), "benchmarks.pools"),
    # `steadyrl bench weight_patches` and `bench weightsync`
    "docs/weights-at-scale.md": lambda: (
        source_numbers(results.load(), "benchmarks.weight_patches")
        | source_numbers(results.load(), "benchmarks.weightsync")
    ),
    # each alert's threshold and duration, as the rules file declares them
    "docs/guides/operate.md": lambda: file_numbers(ROOT / "deploy" / "prometheus" / "alerts.yml"),
}

# (page, figure) that no run measured, and why each may stand
NOT_MEASURED = {
    # the extrapolation's stated link (steadyrl.results.LINK_BYTES_PER_S) and the peers' own published figures
    ("docs/weights-at-scale.md", "1.25 GB/s"),
    ("docs/weights-at-scale.md", "99 %"),
    ("docs/weights-at-scale.md", "50×"),
    # a setting's default or a fixed limit, named beside its setting or constant
    ("docs/concepts/accounting.md", "60 s"),
    ("docs/concepts/glossary.md", "60 s"),
    ("docs/concepts/asynchrony.md", "120 s"),
    ("docs/guides/model-data-reward.md", "10 s"),
    ("docs/guides/multi-node.md", "600 s"),
    ("docs/guides/operate.md", "2 s"),
    ("docs/guides/operate.md", "5 s"),
    ("docs/guides/operate.md", "15 s"),
    ("docs/guides/operate.md", "85%"),
    ("docs/guides/pools.md", "30 s"),
    ("docs/internals/weights.md", "30 s"),
    ("docs/internals/weights.md", "50 MB/s"),
    ("docs/internals/weights.md", "600 s"),
    ("docs/internals/trainer.md", "30 s"),
    ("docs/internals/orchestrator.md", "5 s"),
    ("docs/internals/orchestrator.md", "10 s"),
    ("docs/internals/orchestrator.md", "4 ×"),
    ("docs/internals/inference.md", "20 ms"),
    ("docs/internals/cli.md", "0.1 s"),
    ("docs/internals/cli.md", "0.5 s"),
    ("docs/quickstart.md", "5 s"),
    ("docs/quickstart.md", "5%"),
    ("docs/security.md", "0.1 s"),
    ("docs/security.md", "4 ×"),
    ("docs/security.md", "30 s"),
    ("docs/guides/deploy-compose.md", "10 s"),
    ("docs/guides/deploy-kubernetes.md", "1.5×"),
    ("docs/guides/deploy-kubernetes.md", "2×"),
    ("docs/internals/bench.md", "20 ms"),
    ("docs/internals/bench.md", "2 s"),
    ("docs/internals/bench.md", "5 ms"),
    ("docs/internals/bench.md", "5 s"),
    ("docs/internals/bench.md", "0.1 s"),
    # a test's parameter (the share of calls a seeded reward fails)
    ("docs/security.md", "5 %"),
    ("docs/guides/model-data-reward.md", "5 %"),
    # a hand-run recipe's batch, prompts × samples per prompt (its setting, beside the figures it labels)
    ("docs/guides/pools.md", "64 ×"),
    # the kit's tiny model's stop rule (it builds until its greedy accuracy reaches this)
    ("docs/guides/model-data-reward.md", "30%"),
    # `steadyrl plan`'s arithmetic on a model's size (no run): its tables in the GPU guides
    ("docs/guides/gpus.md", "8 ×"),
    ("docs/guides/gpus.md", "2 ×"),
    ("docs/guides/gpus.md", "183 s"),
    ("docs/guides/gpus.md", "49 s"),
    ("docs/guides/gpus.md", "2 GB/s"),
    ("docs/guides/multi-node.md", "8 ×"),
    ("docs/guides/multi-node.md", "2 ×"),
    ("docs/guides/multi-node.md", "183 s"),
    ("docs/guides/multi-node.md", "2 GB/s"),
    # a deployment's limits, as docker-compose.yml and the GPU overlay set them: the trainer's stop grace
    # period (5m), the startup probes' budget (failureThreshold × periodSeconds) and KEDA's scale-down window
    ("docs/guides/deploy-compose.md", "5 minutes"),
    ("docs/guides/deploy-kubernetes.md", "20 minutes"),
    ("docs/guides/deploy-kubernetes.md", "25 minutes"),
    # the test suite's time budgets (limits the suite is kept under, not timings)
    ("README.md", "20 min"),
    ("README.md", "2 min"),
}


def strip(text: str) -> str:
    """The prose of a page: no code, no rendered blocks, no HTML comments."""
    text = results.BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def found(figure: str, numbers: set[float]) -> bool:
    """Every number of `figure` is one of `numbers` at the precision it is written in (a percentage
    also as a fraction)."""
    for raw in NUMBER.findall(figure):
        value = float(raw.replace(",", ""))
        places = len(raw.split(".")[1]) if "." in raw else 0
        candidates = {round(n, places) for n in numbers}
        if "%" in figure:
            candidates |= {round(100 * n, places) for n in numbers}
        if value not in candidates:
            return False
    return True


def unsourced(page: str, text: str, numbers: set[float] | None) -> list[str]:
    return [
        m.group(0)
        for m in FIGURE.finditer(strip(text))
        if (page, m.group(0)) not in NOT_MEASURED and not (numbers is not None and found(m.group(0), numbers))
    ]


def pages() -> list[str]:
    every = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    names = [p.relative_to(ROOT).as_posix() for p in every]
    return [n for n in names if not n.startswith(GENERATED)]


@pytest.mark.parametrize("page", pages())
def test_every_figure_a_page_quotes_comes_from_its_results(page):
    numbers = SOURCES[page]() if page in SOURCES else None
    assert unsourced(page, (ROOT / page).read_text(), numbers) == []


def test_a_figure_typed_into_a_page_is_caught_and_a_rendered_one_is_not():
    page = (ROOT / "README.md").read_text()
    assert unsourced("README.md", page, None) == []
    typed = page.replace("## The demo", "## The demo\n\nThe run took 142 s and reached 77.3% (0.42 → 0.73).", 1)
    assert unsourced("README.md", typed, None) == ["142 s", "77.3%", "0.42 → 0.73"]
    # a figure the results hold passes where the page names that source, at the precision it is written
    assert found("0.903", {0.9033}) and found("90.3%", {0.9033}) and not found("0.91", {0.9033})


def test_every_page_with_figures_is_what_the_results_render():
    for page, text in results.rendered_pages().items():
        assert (ROOT / page).read_text() == text, f"{page}: run python -m steadyrl.reference_docs"


def test_every_results_block_renders_and_is_used():
    used = set()
    for page in results.PAGES:
        used |= {m.group(2) for m in results.BLOCK.finditer((ROOT / page).read_text())}
    assert used == set(results.RENDERERS)
    data = results.load()
    demo = data["benchmarks"]["demo"]
    table = results.demo_table(data)
    low, high = demo["spread"]["command_seconds"]
    assert f"{low:.0f}" in table and f"{high:.0f}" in table
    assert f"of {demo['runs'][0]['submitted']:,}" in table
    with pytest.raises(KeyError, match="unknown results block"):
        results.render("<!-- results:nope -->x<!-- /results:nope -->", data)


def test_a_span_collapses_equal_ends_and_labels_one_run():
    assert results.span([44.2, 47.9, 45.0], results.seconds, " s") == "44–48 s"
    assert results.span([0.5, 0.5], results.percent, "%") == "50.0%"
    assert results.runs_text(1) == "one run" and results.runs_text(3) == "3 runs, min–max"


def test_every_value_listed_as_not_measured_is_still_on_its_page():
    """An entry whose page no longer quotes it is dropped, so the list stays what the pages say."""
    stale = [
        (page, figure)
        for page, figure in sorted(NOT_MEASURED)
        if figure not in {m.group(0) for m in FIGURE.finditer(strip((ROOT / page).read_text()))}
    ]
    assert stale == []


def test_the_weights_scale_table_puts_collective_beside_shm_where_measured():
    """`bench weight_patches` with `by_transport`: each measured model's row says the collective's seconds and
    ratio after shm's, and the head names both transports; the shm figures and the extrapolation stay as they were."""
    import copy

    data = copy.deepcopy(results.load())
    for side in data["benchmarks"]["weight_patches"].values():  # as recorded before the collective was measured
        if isinstance(side, dict):
            side.pop("by_transport", None)
    before = results.weights_scale(data)
    for key, whole, patch, ratio in (("demo", 0.0131, 0.0142, 1.084), ("qwen3_100m", 0.31, 0.052, 0.168)):
        side = data["benchmarks"]["weight_patches"][key]
        collective = {"refit_seconds": {"whole": whole, "patch": patch}, "refit_patch_over_whole": ratio}
        side["by_transport"] = {"shm": side, "collective": collective}
    after = results.weights_scale(data)
    assert "shm, one thread each" in before and "shm and collective (gloo), one thread each" in after
    rows = after.splitlines()
    (demo,) = [row for row in rows if row.startswith("| the demo's model")]
    (wide,) = [row for row in rows if row.startswith("| ~108M Qwen3-MoE")]
    assert demo.endswith("; by collective: whole 0.013 s, patch 0.014 s (patch / whole 1.084) |")
    assert wide.endswith("; by collective: whole 0.310 s, patch 0.052 s (patch / whole 0.168) |")
    assert [r for r in rows if "extrapolated" in r] == [r for r in before.splitlines() if "extrapolated" in r]
