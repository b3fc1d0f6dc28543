"""The layers import downwards only: the library (`shared`) imports neither the services, the
benchmarks nor the application layer (`steadyrl`); the services import neither the benchmarks
nor the application layer; the benchmarks do not import the application layer (which runs them);
`shared/core` is pure (torch and the standard library only); `shared` is packages alone, each
importing only those below it (SHARED_ORDER); no service imports another (each talks to the others over gRPC and
Redis); and within the benchmarks, the application, the library and each service no two modules import each other,
however indirectly. Checked on the source: every import statement (`from pkg import module` imports pkg.module) and
every string naming a module (`importlib`, `-m`)."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"shared": ("services", "bench", "steadyrl"), "services": ("bench", "steadyrl"), "bench": ("steadyrl",)}
CORE_ALLOWED = {"torch", "shared", "__future__"} | set(sys.stdlib_module_names)


def modules_named(path: Path, runtime_only: bool = False, members: bool = False) -> set[str]:
    """The modules `path` names (imports, `importlib`, `-m`); `runtime_only`: not those imported
    under `if TYPE_CHECKING:` (names for annotations alone); `members`: also `pkg.name` for each
    `from pkg import name`, the module a name imported from a package may be."""
    tree = ast.parse(path.read_text(), str(path))
    named = set()
    typing_only = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                typing_only |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named.add(node.module)
            if members:
                named |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            named.add(str(node.args[0].value))  # importlib.import_module("x.y"), __import__("x.y")
        elif isinstance(node, ast.List | ast.Tuple):  # [sys.executable, "-m", "x.y"]
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            named |= {str(values[i + 1]) for i, v in enumerate(values[:-1]) if v == "-m" and values[i + 1]}
    return named


def sources(package: str, root: Path = ROOT) -> list[Path]:
    return [p for p in sorted((root / package).rglob("*.py")) if "rpc/steadyrl" not in p.as_posix()]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_downwards(package):
    bad = {
        f"{path.relative_to(ROOT)} → {name}"
        for path in sources(package)
        for name in modules_named(path)
        if name.split(".")[0] in FORBIDDEN[package]
    }
    assert not bad, sorted(bad)


def test_the_core_is_pure():
    bad = {
        f"{path.relative_to(ROOT)} → {name}"
        for path in (ROOT / "shared" / "core").glob("*.py")
        for name in modules_named(path)
        if name.split(".")[0] not in CORE_ALLOWED or (name.startswith("shared.") and not name.startswith("shared.core"))
    }
    assert not bad, sorted(bad)


def cycles(package: str, root: Path = ROOT) -> list[list[str]]:
    """The import cycles among the modules of `package` (each found once, from its smallest member)."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts): p for p in sources(package, root)}
    edges = {
        m: sorted({n for n in modules_named(p, members=True) if n in modules and n != m}) for m, p in modules.items()
    }
    found = []

    def visit(path: list[str]) -> None:
        for nxt in edges[path[-1]]:
            if nxt == path[0]:
                found.append(path)
            elif nxt not in path and nxt > path[0]:
                visit([*path, nxt])

    for start in sorted(modules):
        visit([start])
    return found


# shared's packages, lowest first: each may import only those before it
SHARED_ORDER = [
    "core",
    "rpc",
    "runtime",
    "rollouts",
    "runstore",
    "weightsync",
    "tasks",
    "models",
    "envs",
    "engines",
    "kit",
]


def test_shared_is_packages_that_import_downwards():
    loose = sorted(p.name for p in (ROOT / "shared").glob("*.py") if p.name != "__init__.py")
    packages = sorted(p.name for p in (ROOT / "shared").iterdir() if (p / "__init__.py").exists())
    assert loose == [] and packages == sorted(SHARED_ORDER)
    upward = {
        f"{path.relative_to(ROOT)} → {name}"
        for package in SHARED_ORDER
        for path in sources(f"shared/{package}")
        for name in modules_named(path, runtime_only=True)
        if name.startswith("shared.") and name.split(".")[1] in SHARED_ORDER[SHARED_ORDER.index(package) + 1 :]
    }
    assert not upward, sorted(upward)


def services(root: Path = ROOT) -> list[str]:
    return sorted(p.name for p in (root / "services").iterdir() if (p / "__init__.py").exists())


def imports_across_services(root: Path = ROOT) -> set[str]:
    """Each service another service's module imports (`from services import x` included), as `path → services.x`."""
    return {
        f"{path.relative_to(root)} → services.{name.split('.')[1]}"
        for service in services(root)
        for path in sources(f"services/{service}", root)
        for name in modules_named(path, members=True)
        if name.split(".")[0] == "services" and name.split(".")[1:2] not in ([], [service])
    }


@pytest.mark.parametrize("package", ["bench", "steadyrl", "shared", *(f"services/{s}" for s in services())])
def test_no_module_imports_itself_through_others(package):
    assert not cycles(package), cycles(package)


def test_no_service_imports_another():
    assert services() == ["inference", "orchestrator", "trainer", "weightsync"]
    assert not imports_across_services(), sorted(imports_across_services())


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import importlib\nfrom services.trainer import config\nimportlib.import_module('bench.suite')\n"
        "cmd = [python, '-m', 'steadyrl.cli']\nlog = getLogger('steadyrl.trainer')\n"
    )
    assert modules_named(bad) == {"importlib", "services.trainer", "bench.suite", "steadyrl.cli"}


def test_the_cycle_check_sees_a_circle_through_a_spawned_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import x\n")
    (tmp_path / "pkg" / "b.py").write_text("cmd = [python, '-m', 'pkg.c']\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    (tmp_path / "pkg" / "d.py").write_text("import pkg.a\n")
    assert cycles("pkg", tmp_path) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_cycle_check_sees_a_module_imported_from_its_package(tmp_path):
    """`from pkg import b` imports the module pkg.b (even from inside a function); `from pkg.b import a` names a
    member of pkg.b, not a module."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n")
    (tmp_path / "pkg" / "c.py").write_text("from pkg.b import a\n")
    assert cycles("pkg", tmp_path) == [["pkg.a", "pkg.b"]]


def test_the_service_check_sees_one_service_importing_another(tmp_path):
    for service in ("trainer", "inference"):
        (tmp_path / "services" / service).mkdir(parents=True)
        (tmp_path / "services" / service / "__init__.py").write_text("")
    (tmp_path / "services" / "trainer" / "loop.py").write_text(
        "from services.trainer import config\nfrom services import inference\n"
        "def f():\n    from services.inference.worker import RolloutWorker\n"
    )
    (tmp_path / "services" / "inference" / "worker.py").write_text("from services.inference import agents\n")
    assert imports_across_services(tmp_path) == {"services/trainer/loop.py → services.inference"}
    (tmp_path / "services" / "trainer" / "loop.py").write_text("def f():\n    from services import inference\n")
    assert imports_across_services(tmp_path) == {"services/trainer/loop.py → services.inference"}
