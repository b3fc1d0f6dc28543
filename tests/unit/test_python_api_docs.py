"""The Python API page (docs/reference/python-api.md) renders every public extension point its stability
statement names: each module the statement names is a `:::` directive of the page and each directive a
module it names, and the page, built with the site's own mkdocstrings settings, holds each of those
modules and each of their public members (a member without a docstring would be missing)."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "python-api.md"
NAMED = re.compile(r"`(shared(?:\.\w+)+)`")
DIRECTIVE = re.compile(r"^::: (\S+)\n((?:    .*\n)*)", re.MULTILINE)


def statement() -> str:
    """The page's stability statement: its paragraph that says what is public."""
    [paragraph] = [p for p in PAGE.read_text().split("\n\n") if p.startswith("**What is public.**")]
    return paragraph


def directives() -> dict[str, list[str] | None]:
    """Each `::: module` of the page → the members its options list (None: every public one)."""
    import yaml

    out = {}
    for name, options in DIRECTIVE.findall(PAGE.read_text()):
        members = (yaml.safe_load(textwrap.dedent(options)) or {}).get("options", {}).get("members")
        out[name] = members
    return out


def public_members(module: str) -> list[str]:
    """The names a module defines itself (not imports), but private ones: what its directive renders."""
    import griffe

    loaded = griffe.load(module, search_paths=[str(ROOT)])
    return [name for name, member in loaded.members.items() if not member.is_alias and not name.startswith("_")]


def test_each_extension_point_the_statement_names_is_rendered_and_only_those():
    named = NAMED.findall(statement())
    assert named and set(named) == set(directives()), (named, directives())


@pytest.mark.process  # mkdocs
def test_the_built_page_holds_every_public_member_of_each_extension_point(tmp_path):
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())  # the site's plugins, theme and Markdown
    for key in ("hooks", "extra_css", "extra_javascript", "nav"):  # the rest of the site: its own tests
        config.pop(key, None)
    config.get("extra", {}).pop("polyfills", None)
    config["docs_dir"] = str(tmp_path / "docs")
    config["validation"] = {"links": {"not_found": "info", "anchors": "info"}}  # the other pages are not here
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    shutil.copy(PAGE, tmp_path / "docs" / "reference")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml")]
        + ["--site-dir", str(tmp_path / "site")],
        cwd=ROOT,  # the handler's `paths: [.]` of mkdocs.yml: the repository's root
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "WARNING" not in done.stdout, done.stdout[-5000:]
    html = (tmp_path / "site" / "reference" / "python-api.html").read_text()
    missing = [
        f"{module}.{member}" if member else module
        for module, members in directives().items()
        for member in ["", *(members or public_members(module))]
        if f'id="{module}{"." + member if member else ""}"' not in html
    ]
    assert not missing, missing
    # the contract's own words are on the page, not only its names
    assert "may also ask for the problem's dataset row by keyword" in html
    assert "OPENAI_BASE_URL" in html and "STEADYRL_PROMPT" in html
