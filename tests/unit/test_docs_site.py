"""The docs site (mkdocs.yml) builds with `mkdocs build --strict`, and strictly means it: a broken link,
a link to a missing anchor, an absolute link or a page left out of the nav fails the build, naming it; so
does a build without the browser assets `scripts/docs` vendors (scripts/docs-assets/check_assets.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.process


def copy_hooks(to: Path) -> None:
    """The hooks mkdocs.yml names (relative to it) into a copy of the site's sources at `to`."""
    import yaml

    for hook in yaml.safe_load((ROOT / "mkdocs.yml").read_text())["hooks"]:
        (to / hook).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / hook, to / hook)


def build(config: Path, site: Path, assets: str = "optional") -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `config`, run from the repository root (snippets' base path); its
    output (log and errors together) in `stdout`. `assets`: "optional" builds without the vendored
    browser assets where they are missing (the suite needs no npm), "required" as a user's build does."""
    opt_out = {"STEADYRL_DOCS_WITHOUT_ASSETS": "1" if assets == "optional" else ""}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", **opt_out},
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
    # a name in a table wraps only after `.` or `_` (scripts/docs-assets/name_breaks.py); search finds it whole
    assert "<code>STEADYRL_<wbr>TRAINER_<wbr>CHECKPOINT__<wbr>EVERY</code>" in settings
    assert "<td><code>trainer.checkpoint.every</code></td>" in settings  # a row's own name: never broken
    search = (site / "search" / "search_index.js").read_text()
    assert search.startswith("var __index = ") and "STEADYRL_TRAINER_CHECKPOINT__EVERY" in search  # offline search
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
    copy_hooks(tmp_path)
    (tmp_path / "docs" / "REPRODUCTION.md").write_text("# Reproduction\n")  # its plots were not copied
    for page, addition, _ in BREAKAGES.values():
        target = tmp_path / "docs" / page
        target.write_text((target.read_text() if target.exists() else "") + addition)
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "warnings in strict mode!" in done.stdout, done.stdout[-5000:]
    missed = [name for name, (_, _, warning) in BREAKAGES.items() if warning not in done.stdout]
    assert not missed, f"{missed} did not fail the build: {done.stdout[-5000:]}"


def test_a_build_without_the_vendored_assets_fails_naming_scripts_docs(tmp_path):
    """A plain `mkdocs build` where `scripts/docs` never vendored KaTeX and the iframe-worker shim stops, saying
    how to build; STEADYRL_DOCS_WITHOUT_ASSETS=1 builds the site without them, saying so."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["nav"] = ["index.md"]  # one page: the hook runs before any page is read
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    copy_hooks(tmp_path)
    shutil.copytree(ROOT / "docs" / "stylesheets", tmp_path / "docs" / "stylesheets")
    (tmp_path / "docs" / "javascripts").mkdir()
    shutil.copy(ROOT / "docs" / "javascripts" / "katex.js", tmp_path / "docs" / "javascripts")
    (tmp_path / "docs" / "index.md").write_text("# steadyrl\n\n\\( \\pi_\\theta \\)\n")
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site", assets="required")
    assert done.returncode != 0 and "Aborted with a BuildError!" in done.stdout, done.stdout[-3000:]
    assert "browser assets are missing from docs/javascripts/vendor/ (katex/katex.min.css" in done.stdout
    assert "Build it with `scripts/docs build`" in done.stdout and not (tmp_path / "site" / "index.html").exists()
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "built WITHOUT the browser assets in docs/javascripts/vendor/" in done.stdout
    assert (tmp_path / "site" / "index.html").exists()
