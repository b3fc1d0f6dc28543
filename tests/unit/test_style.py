"""The code's layout is the formatter's and lint is clean, E501 (lines past 120) and BLE001 (a
broad except without its reason on the line) included: `ruff format --check` and `ruff check`."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is missing: it comes with the test extra (scripts/install)")
    return found


@pytest.mark.parametrize("command", [["format", "--check", "."], ["check", "."]], ids=["format", "lint"])
def test_ruff_is_clean(command):
    done = subprocess.run([ruff(), *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_the_lint_selects_line_length_and_broad_excepts():
    import tomllib

    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert lint["line-length"] == 120
    assert {"E", "BLE"} <= set(lint["lint"]["select"]) and "E501" not in lint["lint"].get("ignore", [])


def test_docstrings_say_what_and_why_in_a_few_lines():
    """Over 800 characters, an explanation belongs on a docs page the docstring links (docs/internals/)."""
    import ast

    long = []
    for path in ROOT.rglob("*.py"):
        if {".venv", "node_modules"} & set(path.parts) or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                if len(doc) > 800:
                    long.append(f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')} ({len(doc)})")
    assert not long, long
