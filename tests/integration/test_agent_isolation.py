"""Agent programs are untrusted (docs/security.md): on a real replica
an agent program finds none of the run's secrets (its environment holds its endpoint, its session
key, its prompt and what the recipe names; the run's directory is hidden), sees no other process,
leaves nothing running behind it, and cannot call another trajectory's session."""

import asyncio
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from redis.asyncio import Redis

from services.inference import trajectories
from shared.envs import isolation
from shared.runstore.queues import WorkQueue
from tests.helpers import submit
from tests.integration.test_agents import agent_task
from tests.integration.test_inference import Replica, wait_for
from tests.integration.test_multiturn_replica import _dead

pytestmark = pytest.mark.skipif(isolation.unavailable() is not None, reason=f"{isolation.unavailable()}")
MARKER = "31337.5"  # `sleep 31337.5`: the process the probe leaves behind, found by its arguments


def processes_with(marker: str) -> list[str]:
    done = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if f"sleep {marker}" in line]


def test_an_agent_program_finds_no_secret_no_process_and_leaves_nothing_behind(
    tmp_path, calc_model_dir, redis_server, run_id, monkeypatch
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    token = run_dir / "token"
    token.write_text("the-run-token")
    monkeypatch.setenv("STEADYRL_TEST_PASSED", "named-by-the-recipe")
    monkeypatch.setenv("STEADYRL_TEST_SECRET", "never-passed")
    monkeypatch.setenv("STEADYRL_TOKEN_FILE", str(token))
    probe = agent_task("probe", group_size=2)
    probe.environment = f"agent:{sys.executable} -m tests.agent_probe {token} {MARKER}"

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        async with Replica(
            tmp_path,
            calc_model_dir,
            redis_server.url,
            run_id,
            agent={"endpoint": True, "env": ["STEADYRL_TEST_PASSED"], "hidden_paths": [run_dir]},
        ):
            await submit(queue, probe)
            await wait_for(lambda: _dead(queue, 1), 60)
            dead = {f[b"task_id"].decode(): f for _, f in await redis.xrange(queue.run_keys.dead)}
        await redis.aclose()
        return dead

    dead = asyncio.run(asyncio.wait_for(main(), 120))
    reason = dead["probe"][b"reason"].decode()
    report = dict(item.split("=", 1) for item in reason.split("REPORT ", 1)[1].split())
    assert report == {
        "token": "0",
        "token_dir": "0",
        "processes": "1",
        "urls": "0",
        "passed": "named-by-the-recipe",
        "leaked": "-",
        "key": "1",
    }, reason  # one other process: bubblewrap's init
    assert processes_with(MARKER) == []


def test_a_session_answers_only_calls_that_carry_its_key(tmp_path, calc_model_dir, redis_server, run_id):
    """A process that learns a session's URL (a sibling agent) can neither read nor change it."""
    hold = agent_task("held", " --hang")

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        async with Replica(tmp_path, calc_model_dir, redis_server.url, run_id, agent={"endpoint": True}):
            endpoint = trajectories.ENDPOINT[0]
            await submit(queue, hold)
            await wait_for(lambda: _sessions(endpoint), 60)
            session_id, session = next(iter(endpoint.sessions.items()))
            url = f"{endpoint.base_url}/rollouts/{session_id}/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "12*34="}]}
            answers = [await asyncio.to_thread(post, url, body, key) for key in (None, "steadyrl", "x" * 43)]
            state = (session.trajectory, list(session.conversation), session.error)
            good = await asyncio.to_thread(post, url, body, session.key)
        await redis.aclose()
        return answers, state, good

    answers, state, good = asyncio.run(asyncio.wait_for(main(), 120))
    assert [a[0] for a in answers] == [401, 401, 401] and all(a[1]["error"]["type"] == "unauthorized" for a in answers)
    assert state == (None, [], None)
    assert good[0] == 200 and good[1]["object"] == "chat.completion"


async def _sessions(endpoint) -> bool:
    return bool(endpoint.sessions)


def post(url: str, body: dict, key: str | None) -> tuple[int, dict]:
    import json

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
