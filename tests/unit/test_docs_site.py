"""The docs site (mkdocs.yml) builds with `mkdocs build --strict`, and strictly means it: a broken link,
a link to a missing anchor, an absolute link or a page left out of the nav fails the build, naming it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.process


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `config`, run from the repository root (snippets' base path); its
    output (log and errors together) in `stdout`."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )


def test_the_site_builds_strictly(tmp_path):
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout[-5000:]
    assert "WARNING" not in done.stdout, done.stdout[-5000:]
    site = tmp_path / "site"
    settings = (site / "reference" / "settings.html").read_text()
    assert "STEADYRL_TRAINER_CHECKPOINT__EVERY" in settings
    assert (site / "search" / "search_index.js").read_text().startswith("var __index = ")  # offline search
    assert (site / "reproduction" / "eval_accuracy.png").is_file()  # REPRODUCTION.md's plots
    assert not (site / "reproduction" / "results.csv").exists() and not (site / "gpu").exists()


BREAKAGES = {  # what is added to which page, and the warning that names it
    "missing page": (
        "internals/rpc.md",
        "\n[gone](no-such-page.md)\n",
        "WARNING -  Doc file 'internals/rpc.md' contains a link 'no-such-page.md', but the target",
    ),
    "missing anchor": (
        "internals/rpc.md",
        "\n[gone](../reference/cli.md#no-such-heading)\n",
        "WARNING -  Doc file 'internals/rpc.md' contains a link '../reference/cli.md#no-such-heading', but",
    ),
    "absolute link": (
        "internals/rpc.md",
        "\n[gone](/reference/cli.md)\n",
        "WARNING -  Doc file 'internals/rpc.md' contains an absolute link '/reference/cli.md'",
    ),
    "page out of the nav": (
        "internals/orphan.md",
        "# Orphan\n",
        'are not included in the "nav" configuration:\n  - internals/orphan.md\n',
    ),
}


def test_each_broken_link_and_a_page_out_of_the_nav_fail_the_build(tmp_path):
    """One build of a copy holding every breakage, each named in its output (one build: seconds, not four)."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("reproduction", "gpu"))
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "docs" / "REPRODUCTION.md").write_text("# Reproduction\n")  # its plots were not copied
    for page, addition, _ in BREAKAGES.values():
        target = tmp_path / "docs" / page
        target.write_text((target.read_text() if target.exists() else "") + addition)
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "warnings in strict mode!" in done.stdout, done.stdout[-5000:]
    missed = [name for name, (_, _, warning) in BREAKAGES.items() if warning not in done.stdout]
    assert not missed, f"{missed} did not fail the build: {done.stdout[-5000:]}"
