"""What the code and the docs name exists: every `shared.x.Y`-style reference in a docstring,
comment or page resolves to a module and a name defined in it; nothing cites a design file the
repository does not hold."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "services", "steadyrl", "bench")
DOTTED = re.compile(r"`((?:shared|services|steadyrl|bench)(?:\.[A-Za-z_]\w*)+)")
NOT_PYTHON = ("steadyrl.v1", "steadyrl.run_id", "steadyrl.io")  # the proto package; an MLflow tag; a k8s label


def texts() -> list[Path]:
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if "rpc/steadyrl" not in p.as_posix()]
    return [*files, ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def unresolved(reference: str) -> str | None:
    """Why `reference` (a.b.c) names nothing, or None when it resolves."""
    parts = reference.split(".")
    for i in range(len(parts), 0, -1):
        module = ROOT.joinpath(*parts[:i])
        source = module.with_suffix(".py") if module.with_suffix(".py").exists() else module / "__init__.py"
        if source.exists():
            break
    else:
        return "no such module"
    if i == len(parts):
        return None
    name = parts[i]
    defined = rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|^from \S+ import .*\b{name}\b"
    return None if re.search(defined, source.read_text(), re.MULTILINE) else f"{name} is not defined in {source.name}"


def test_every_dotted_reference_resolves():
    bad = [
        f"{path.relative_to(ROOT)}: {ref} ({why})"
        for path in texts()
        for ref in set(DOTTED.findall(path.read_text()))
        if not ref.startswith(NOT_PYTHON) and (why := unresolved(ref))
    ]
    assert not bad, bad


def test_the_check_sees_what_does_not_exist():
    assert unresolved("shared.runstore.keys.RunKeys") is None and unresolved("shared.core") is None
    assert unresolved("shared.weightsync.grpc.WatchSubscriber") == "WatchSubscriber is not defined in grpc.py"
    assert unresolved("shared.nowhere.X") == "nowhere is not defined in __init__.py"


def test_no_design_file_outside_the_repository_is_cited():
    cited = [str(p.relative_to(ROOT)) for p in texts() if "DESIGN.md" in p.read_text()]
    assert not cited, cited
