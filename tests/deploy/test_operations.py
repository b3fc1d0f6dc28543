"""Operating a deployment, for real: a replica's /metrics answers while its model loads (loading
gauge 1, the run label on every sample) and it builds its settings from STEADYRL_RECIPE; a real
Alertmanager with deploy/alertmanager/alertmanager.yml inhibits an alert's consequences."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shared.runstore.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]

SLOW_LOAD = """
import pathlib, sys, time
import services.inference.server as server
real = server.load_engine
def held(settings):  # the model load waits for the test's flag: a cold start held open
    while not pathlib.Path(sys.argv[1]).exists():
        time.sleep(0.05)
    return real(settings)
server.load_engine = held
from steadyrl.cli import app
app(["serve", "inference"])  # as compose and the manifests start it
"""


def scrape(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return ""


def wait_for(port: int, pattern: str, process: subprocess.Popen, seconds: float = 120) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the replica exited with {process.returncode}"
        text = scrape(port)
        if re.search(pattern, text, re.M):
            return text
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} on /metrics within {seconds} s:\n{scrape(port)[-3000:]}")


def test_a_replica_serves_metrics_while_its_model_loads_and_reads_its_recipe(redis_server, tiny_model_dir, tmp_path):
    """A replica started as a deployment starts it (STEADYRL_RECIPE = configs/tiny-arith.toml, its
    own variables only placing it) answers /metrics from before its model loads, with
    steadyrl_service_loading 1 and no policy version yet, every sample labelled with the recipe's
    run id; once loaded: loading 0 and its version, labelled with its pool."""
    flag = tmp_path / "load"
    grpc_port = free_port()
    metrics_port = free_port()
    env = {
        **os.environ,
        "STEADYRL_RECIPE": str(ROOT / "configs" / "tiny-arith.toml"),
        "STEADYRL_INFERENCE_MODEL_PATH": str(tiny_model_dir),
        "STEADYRL_INFERENCE_REDIS_URL": redis_server.url,
        "STEADYRL_INFERENCE_PORT": str(grpc_port),
        "STEADYRL_INFERENCE_METRICS_PORT": str(metrics_port),
        "STEADYRL_INFERENCE_REPLICA_ID": "replica-cold",
    }
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_LOAD, str(flag)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        loading = wait_for(metrics_port, r'^steadyrl_service_loading\{.*service="inference".*\} 1\.0$', process)
        assert 'pool="rollouts"' in loading and "steadyrl_inference_policy_version{" not in loading
        samples = [line for line in loading.splitlines() if line and not line.startswith("#")]
        assert samples and all('run="tiny-arith"' in line for line in samples)  # the recipe's [run] id
        flag.touch()
        served = wait_for(metrics_port, r"^steadyrl_inference_policy_version\{.*\} 0\.0$", process)
        assert re.search(r'^steadyrl_service_loading\{.*service="inference".*\} 0\.0$', served, re.M)
        assert re.search(
            r'^steadyrl_inference_policy_version\{pool="rollouts",replica="replica-cold",'
            r'run="tiny-arith"\} 0\.0$',
            served,
            re.M,
        )
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err[-3000:]
    assert "max_inflight_tasks=16" in err or "event=started" in err  # it started with the recipe's settings


def test_a_recipe_a_service_cannot_use_stops_it_before_anything_starts(tmp_path):
    """`steadyrl serve` refuses a recipe naming a bad value (exit 2, the field named); a service
    started without it refuses STEADYRL_RECIPE instead of ignoring it."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nid = "x"\n[weightsync]\nmemory_versions = 0\n')
    env = {**os.environ, "STEADYRL_RECIPE": str(bad)}
    done = subprocess.run(
        [sys.executable, "-m", "steadyrl.cli", "serve", "weightsync"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2 and "event=settings_refused service=weightsync" in done.stderr
    assert "memory_versions" in done.stderr
    bypass = subprocess.run(
        [sys.executable, "-m", "services.weightsync"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )
    assert (
        bypass.returncode == 2
        and "STEADYRL_RECIPE is read by `python -m steadyrl.cli serve weightsync`" in bypass.stderr
    )
    unknown = subprocess.run(
        [sys.executable, "-m", "steadyrl.cli", "serve", "trainr"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert unknown.returncode == 2 and "not 'trainr'" in unknown.stderr


def test_a_service_waits_a_bounded_time_for_its_model(tmp_path):
    """`steadyrl serve --model-wait S` (compose's services, beside the model-init job writing the model):
    absent past S, exit 2 with the reason; present, no wait."""
    env = {
        **os.environ,
        "STEADYRL_ORCHESTRATOR_MODEL_PATH": str(tmp_path / "absent"),
        "STEADYRL_ORCHESTRATOR_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    command = [sys.executable, "-m", "steadyrl.cli", "serve", "orchestrator", "--model-wait", "1.5"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and "event=model_missing service=orchestrator" in done.stderr
    assert "no model (config.json) within 1.5 s" in done.stderr and time.monotonic() - started >= 1.5


def alertmanager() -> str:
    found = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    assert found, "alertmanager is missing: scripts/install installs Debian's prometheus-alertmanager as root"
    return found


def test_alertmanager_config_checks_and_inhibits_consequences_of_a_cause(tmp_path):
    """amtool accepts deploy/alertmanager/alertmanager.yml; a real Alertmanager running it, given
    ServiceDown with TrainerStalled and RolloutsStarved, keeps the cause active and inhibits the
    two consequences; without the cause they are active; critical alerts route to `page`."""
    config = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
    amtool = shutil.which("amtool")
    assert amtool, "amtool is missing: scripts/install installs Debian's prometheus-alertmanager as root"
    checked = subprocess.run([amtool, "check-config", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    routed = subprocess.run(
        [
            amtool,
            "config",
            "routes",
            "test",
            "--config.file",
            str(config),
            "severity=critical",
            "alertname=SteadyrlServiceDown",
        ],
        capture_output=True,
        text=True,
    )
    assert routed.stdout.strip() == "page", routed.stdout + routed.stderr
    port = free_port()
    server = subprocess.Popen(
        [
            alertmanager(),
            f"--config.file={config}",
            f"--storage.path={tmp_path}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api/v2/alerts"

    def post(*names: str, run: str) -> None:
        alerts = [{"labels": {"alertname": n, "severity": "critical", "run": run}} for n in names]
        httpx.post(api, json=alerts, timeout=5).raise_for_status()

    def states(run: str) -> dict[str, str]:
        alerts = httpx.get(api, params={"filter": f'run="{run}"'}, timeout=5).json()
        return {a["labels"]["alertname"]: a["status"]["state"] for a in alerts}

    try:
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        post("SteadyrlTrainerStalled", "SteadyrlRolloutsStarved", run="alone")
        post("SteadyrlServiceDown", "SteadyrlTrainerStalled", "SteadyrlRolloutsStarved", run="down")
        expected = {
            "alone": {"SteadyrlTrainerStalled": "suppressed", "SteadyrlRolloutsStarved": "active"},
            "down": {
                "SteadyrlServiceDown": "active",
                "SteadyrlTrainerStalled": "suppressed",
                "SteadyrlRolloutsStarved": "suppressed",
            },
        }
        deadline = time.monotonic() + 30
        while {run: states(run) for run in expected} != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {run: states(run) for run in expected} == expected  # starving explains the stall, a target down both
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(20)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
