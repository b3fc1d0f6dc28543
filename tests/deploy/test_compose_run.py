"""docker-compose.yml's services run for real, without Docker: each started with exactly the
command and environment compose gives it (`steadyrl serve SERVICE`, the recipe from
STEADYRL_RECIPE, the secrets as files), only the container's names, ports and paths mapped onto
this machine's loopback and a temporary folder. The recipe alone decides the run: the services
train it to the end, with a Redis password that would need escaping in a URL."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from shared.runstore.redis_server import RedisServer
from shared.weightsync.signing import write_key_pair
from steadyrl.ports import PortReservations
from tests.deploy.test_deploy import interpolate, service_of

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("weightsync", "trainer", "inference", "orchestrator")
HOSTS = ("redis", "weightsync", "trainer", "orchestrator", "0.0.0.0")


def placed(env: dict[str, str], ports: dict[str, str], paths: dict[str, str]) -> dict[str, str]:
    """A compose environment on this machine: its hosts on loopback, its ports free ones, its paths in tmp."""
    out = {}
    for key, value in env.items():
        value = interpolate(str(value))
        for path, local in paths.items():
            value = value.replace(path, local)
        hosts = "|".join(map(re.escape, HOSTS))
        value = re.sub(rf"\b({hosts})(?=:\d)", "127.0.0.1", value)  # host:port, in an address or a URL
        value = re.sub(rf"^({hosts})$", "127.0.0.1", value)  # a bare host name (not a path's last part)
        value = re.sub(r"(?<![\d.])(\d{4,5})\b", lambda m: ports.get(m.group(1), m.group(1)), value)
        out[key] = value
    return out


def test_the_compose_services_train_the_recipe_they_read(tmp_path, tiny_model_dir):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    password = "p@ss/w:rd#%"  # would break a URL unescaped: the services read it from its file
    for name, value in (("token", "compose-token"), ("redis_password", password)):
        (secrets / name).write_text(value + "\n")
    write_key_pair(secrets, "weights_signing_key", "weights_verify_key")  # what `steadyrl keys` makes
    redis = RedisServer(tmp_path / "redis", password=password).start()
    short = tmp_path / "short.toml"  # merged over the compose recipe: a short run
    short.write_text("[run]\nsteps = 3\nbatch_prompts = 4\n[orchestrator.evals]\nevery = 0\n")
    held = PortReservations()  # distinct ports below the ephemeral range, let go just before the services start
    ports = {p: str(held.take()) for p in ("50051", "50052", "50053", "50054", "8080", "9101", "9102", "9103")}
    ports["6379"] = str(redis.port)
    paths = {
        "/run/secrets": str(secrets),
        "/models/tiny": str(tiny_model_dir),
        "/home/steadyrl/runs": str(tmp_path),
        "/spill": str(tmp_path / "spill"),
        "/tmp/steadyrl-cache": str(tmp_path / "cache"),
        "/etc/steadyrl/tiny-arith.toml": f"{ROOT / 'configs' / 'tiny-arith.toml'},{short}",
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith("STEADYRL_")}
    processes = {}
    with contextlib.ExitStack() as files:
        logs = {name: files.enter_context(open(tmp_path / f"{name}.log", "w")) for name in ORDER}
        held.close()
        codes = start_and_finish(compose, processes, logs, ports, paths, base, tmp_path, redis)
    assert codes == dict.fromkeys(ORDER, 0), codes
    text = {name: (tmp_path / f"{name}.log").read_text() for name in ORDER}
    assert "signed=True" in text["weightsync"]  # the verify key from its secret file: every version checked
    lines = [json.loads(x) for x in (tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert "event=weights_applied version=3" in text["inference"]
    assert password not in "".join(text.values())  # never logged


def start_and_finish(compose, processes, logs, ports, paths, base, tmp_path, redis) -> dict[str, int]:
    """Start the services as compose would, wait for the run to finish, stop them: their exit codes."""
    try:
        for name in ORDER:
            service = compose["services"][name]
            assert service_of(service["command"]) == name
            env = placed(service["environment"], ports, paths)
            env["HOME"] = str(tmp_path)
            processes[name] = subprocess.Popen(
                [sys.executable, "-m", *service["command"]],
                cwd=tmp_path,
                env={**base, **env},
                stdout=logs[name],
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{ports['8080']}/v1/run"
        status = {}
        deadline = time.monotonic() + 240
        while status.get("state") != "finished" and time.monotonic() < deadline:
            for name, process in processes.items():
                # the trainer exits 0 once its last step is published: that may come before the
                # orchestrator's tick calls the run finished
                ended = process.poll()
                assert ended is None or (name == "trainer" and ended == 0), (
                    name,
                    (tmp_path / f"{name}.log").read_text()[-3000:],
                )
            with contextlib.suppress(httpx.HTTPError, json.JSONDecodeError):
                status = httpx.get(url, headers={"Authorization": "Bearer compose-token"}, timeout=2).json()
            time.sleep(0.5)
        assert status.get("state") == "finished", status
        assert status["run_id"] == "tiny-arith" and status["trainer_step"] == 3  # the recipe's id, the merge's steps
        assert httpx.get(url, timeout=2).status_code == 401  # the token file is the token
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = {name: process.wait(60) for name, process in processes.items()}
        redis.stop()
    return codes
