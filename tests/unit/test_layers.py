"""The layers import downwards only: the library (`shared`) imports neither the services, the
benchmarks nor the application layer (`steadyrl`); the services import neither the benchmarks
nor the application layer; `shared/core` is pure (torch and the standard library only). Checked
on the source: every import statement and every string naming a module (`importlib`, `-m`)."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"shared": ("services", "bench", "steadyrl"), "services": ("bench", "steadyrl")}
CORE_ALLOWED = {"torch", "shared", "__future__"} | set(sys.stdlib_module_names)


def modules_named(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            named.add(str(node.args[0].value))  # importlib.import_module("x.y"), __import__("x.y")
        elif isinstance(node, ast.List | ast.Tuple):  # [sys.executable, "-m", "x.y"]
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            named |= {str(values[i + 1]) for i, v in enumerate(values[:-1]) if v == "-m" and values[i + 1]}
    return named


def sources(package: str) -> list[Path]:
    return [p for p in sorted((ROOT / package).rglob("*.py")) if "rpc/steadyrl" not in p.as_posix()]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_downwards(package):
    bad = {f"{path.relative_to(ROOT)} → {name}" for path in sources(package) for name in modules_named(path)
           if name.split(".")[0] in FORBIDDEN[package]}
    assert not bad, sorted(bad)


def test_the_core_is_pure():
    bad = {f"{path.relative_to(ROOT)} → {name}" for path in (ROOT / "shared" / "core").glob("*.py")
           for name in modules_named(path) if name.split(".")[0] not in CORE_ALLOWED
           or (name.startswith("shared.") and not name.startswith("shared.core"))}
    assert not bad, sorted(bad)


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import importlib\nfrom services.trainer import config\nimportlib.import_module('bench.suite')\n"
                   "cmd = [python, '-m', 'steadyrl.cli']\nlog = getLogger('steadyrl.trainer')\n")
    assert modules_named(bad) == {"importlib", "services.trainer", "bench.suite", "steadyrl.cli"}
