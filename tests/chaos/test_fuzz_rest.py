"""Schemathesis against a real orchestrator process's OpenAPI spec: every operation gets generated
requests, with the token, with a wrong one and without; no 5xx, every error is JSON, and the process
stays up. The counts are printed (run with -s to see them)."""

import collections
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from shared.runstore.redis_server import free_port

TOKEN = "rest-fuzz-token"
EXAMPLES = 60


@pytest.fixture(scope="module")
def control_plane(redis_server, tiny_model_dir, tmp_path_factory):
    port = free_port()
    run_id = f"fuzz{os.getpid()}"
    env = {
        **os.environ,
        "STEADYRL_TOKEN": TOKEN,
        "STEADYRL_ORCHESTRATOR_HTTP_PORT": str(port),
        "STEADYRL_ORCHESTRATOR_GRPC_PORT": str(free_port()),
        "STEADYRL_ORCHESTRATOR_METRICS_PORT": "0",
        "STEADYRL_ORCHESTRATOR_MODEL_PATH": str(tiny_model_dir),
        "STEADYRL_ORCHESTRATOR_REDIS_URL": redis_server.url,
        "STEADYRL_ORCHESTRATOR_RUN_ID": run_id,
        "STEADYRL_ORCHESTRATOR_OUT_DIR": str(tmp_path_factory.mktemp("o")),
        "STEADYRL_ORCHESTRATOR_TRAINER_ADDRESS": f"127.0.0.1:{free_port()}",
    }
    process = subprocess.Popen([sys.executable, "-m", "services.orchestrator"], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, f"orchestrator exited with {process.returncode}"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)
    yield url, process
    process.terminate()
    process.wait(20)


HEADERS = {"token": {"Authorization": f"Bearer {TOKEN}"}, "wrong": {"Authorization": "Bearer nope"}, "none": {}}


def fuzz(url: str, operation, auth: str, outcomes: collections.Counter, failures: list) -> None:
    """EXAMPLES generated requests to one operation with one kind of credentials."""
    name = f"{operation.method.upper()} {operation.path}"

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def probe(case):
        response = case.call(base_url=url, headers=HEADERS[auth], timeout=10)
        key = f"{name} [{auth}] {response.status_code}"
        outcomes[key] += 1
        if response.status_code >= 500:
            failures.append((key, case.path_parameters, response.text[:200]))
        elif response.status_code >= 400:
            body = response.json()  # every error is JSON with a detail
            assert isinstance(body.get("detail"), str | list), body
        if operation.path.startswith("/v1/") and auth != "token":
            assert response.status_code == 401, key

    probe()


def test_rest_api_fuzz(control_plane):
    url, process = control_plane
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=HEADERS["token"])  # behind the token
    outcomes: collections.Counter = collections.Counter()
    failures: list = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} == {
        "GET /health",
        "GET /metrics",
        "GET /v1/run",
        "GET /v1/run/config",
        "POST /v1/run/{action}",
    }
    for operation in operations:
        for auth in HEADERS:
            fuzz(url, operation, auth, outcomes, failures)
    print(json.dumps({"inputs": sum(outcomes.values()), "by_outcome": dict(sorted(outcomes.items()))}, indent=1))
    assert not failures, failures[:5]
    assert process.poll() is None and httpx.get(f"{url}/health").status_code == 200
    assert sum(outcomes.values()) >= 5 * 3 * 2  # every operation × credentials was really exercised
