"""Each status the control plane's schema lists, provoked on the real app against a real redis-server
(or none): 401, 404, 409, 413, 503; and the fullest status the code sends validates against RunStatus."""

import asyncio
import json
from typing import get_type_hints

import httpx
from redis.asyncio import Redis

from services.orchestrator import api_models as api
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.orchestrator import Orchestrator
from services.orchestrator.server import create_app
from shared.runstore.keys import RunField
from shared.runstore.redis_server import free_port
from tests.integration.test_control_plane import TOKEN, run_settings

HEADERS = {"Authorization": f"Bearer {TOKEN}"}  # the right token
GUARDED = [("GET", "/v1/run"), ("GET", "/v1/run/config"), ("POST", "/v1/run/start")]
ROUTES = [("GET", "/health"), ("GET", "/metrics"), *GUARDED]


def client(orchestrator: Orchestrator, **limits) -> httpx.AsyncClient:
    """The real app; a route's exception is answered as the server answers it (500), not raised here."""
    transport = httpx.ASGITransport(app=create_app(orchestrator, TOKEN, **limits), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def dead_redis_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


def test_401_404_409_and_413_on_a_real_redis(redis_server, run_id, tiny_model_dir, tmp_path):
    async def main():
        redis = Redis.from_url(redis_server.url)
        orchestrator = Orchestrator(
            run_settings(redis_server, run_id, tiny_model_dir, tmp_path, evals={"size": 5}), redis
        )
        replies = {}
        async with client(orchestrator, max_request_bytes=4096) as http:
            for method, path in GUARDED:
                replies[method, path, "none"] = await http.request(method, path)
                replies[method, path, "wrong"] = await http.request(
                    method, path, headers={"Authorization": "Bearer no"}
                )
            for action in ("explode", "START", "start%20", "x" * 300):
                replies["POST", action] = await http.post(f"/v1/run/{action}", headers=HEADERS)
            replies["resume"] = await http.post("/v1/run/resume", headers=HEADERS)  # the run is created: not paused
            for method, path in ROUTES:
                replies[method, path, "large"] = await http.request(method, path, headers=HEADERS, content=b"x" * 4097)
            state = await orchestrator.state()
        await orchestrator.close()
        await redis.aclose()
        return replies, state

    replies, state = asyncio.run(asyncio.wait_for(main(), 60))
    for method, path in GUARDED:
        for token in ("none", "wrong"):
            reply = replies[method, path, token]
            assert reply.status_code == 401 and reply.json() == {"detail": "missing or wrong bearer token"}
            assert reply.headers["www-authenticate"] == "Bearer"
    unknown = replies["POST", "explode"]
    assert unknown.status_code == 404
    assert unknown.json() == {"detail": "unknown action 'explode'; one of ['pause', 'resume', 'start', 'stop']"}
    assert [replies["POST", a].status_code for a in ("START", "start%20", "x" * 300)] == [404, 404, 404]  # never 422
    assert replies["POST", "x" * 300].json()["detail"].startswith(f"unknown action {'x' * 64!r};")  # not echoed whole
    assert replies["resume"].status_code == 409 and replies["resume"].json() == {
        "detail": "cannot resume a run that is created"
    }
    for method, path in ROUTES:
        reply = replies[method, path, "large"]
        assert reply.status_code == 413, (method, path)
        assert reply.json() == {"detail": "request body over 4096 bytes (orchestrator.control.max_request_bytes)"}
    assert state == "created"  # nothing refused was applied


def test_503_when_redis_does_not_answer_and_no_status_was_read(run_id, tiny_model_dir, tmp_path):
    """Nothing listens on the Redis port: GET /v1/run with no status read before and every transition
    answer 503 (JSON, Retry-After); the config needs no Redis. A last status that is not a RunStatus
    is never sent: the reply is validated (500)."""

    async def main():
        url = dead_redis_url()
        redis = Redis.from_url(url)
        settings = OrchestratorSettings(
            model_path=str(tiny_model_dir),
            redis_url=url,
            run_id=run_id,
            out_dir=tmp_path,
            evals={"size": 5},
            control={"timeout_seconds": 1.0},
        )
        orchestrator = Orchestrator(settings, redis)
        async with client(orchestrator) as http:
            status = await http.get("/v1/run", headers=HEADERS)
            actions = [await http.post(f"/v1/run/{a}", headers=HEADERS) for a in ("start", "pause", "resume", "stop")]
            config = await http.get("/v1/run/config", headers=HEADERS)
            orchestrator.bounded.keep({"run_id": run_id, "state": "running"})  # not a RunStatus: the app sends no such
            half = await http.get("/v1/run", headers=HEADERS)
        await orchestrator.close()
        await redis.aclose()
        return status, actions, config, half

    status, actions, config, half = asyncio.run(asyncio.wait_for(main(), 60))
    for reply in (status, *actions):
        assert reply.status_code == 503 and reply.headers["retry-after"] == "2"
        body = reply.json()
        assert set(body) == {"detail", "retry_after_seconds"} and body["retry_after_seconds"] == 2
        assert "Redis did not answer" in body["detail"] and "nothing was applied" in body["detail"]
    assert status.json()["detail"].startswith("status: ") and actions[0].json()["detail"].startswith("start: ")
    assert config.status_code == 200 and config.json()["run_id"] == run_id
    assert half.status_code == 500 and half.json() == {"detail": "internal error: ResponseValidationError"}


def test_the_fullest_status_validates_and_is_sent_whole(redis_server, run_id, tiny_model_dir, tmp_path):
    """A failed run with replicas, dead letters, the trainer's staleness, μ's and π's evals, then the
    same status read back stale: the reply is the code's dict exactly, every key declared."""

    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = run_settings(
            redis_server,
            run_id,
            tiny_model_dir,
            tmp_path,
            evals={"size": 5, "policy": True},
            control={"timeout_seconds": 1.0},
        )
        orchestrator = Orchestrator(settings, redis)
        keys = orchestrator.keys
        await redis.hset(
            keys.run,
            mapping={"state": "failed", RunField.FAILURE: json.dumps({"rule": "stalled", "reason": "no step"})},
        )
        await redis.hset(keys.replicas, mapping={"r0": 3, "r1": 2})
        await redis.hset(keys.dead_counts, "attempts", 2)
        await redis.hset(keys.rollouts_dead_counts, "oversize", 1)
        orchestrator.trainer_metrics = {
            "staleness_mean": 0.5,
            "staleness_peak": 1.0,
            "dropped_stale": 4.0,
            "loss": -0.25,
        }
        orchestrator.evals.results = {0: {"main": {"correct": 2, "n": 5}}}
        orchestrator.evals.policy_results = {0: {"main": {"correct": 3, "n": 5}}}
        async with client(orchestrator) as http:
            live = await http.get("/v1/run", headers=HEADERS)
            expected = await orchestrator.status()
            orchestrator.redis = Redis.from_url(dead_redis_url())  # Redis is gone: the status read fails
            stale = await http.get("/v1/run", headers=HEADERS)
        await orchestrator.close()
        await orchestrator.redis.aclose()
        await redis.aclose()
        return live, expected, stale

    live, expected, stale = asyncio.run(asyncio.wait_for(main(), 60))
    assert live.status_code == 200 and live.json() == expected
    assert set(live.json()) == set(get_type_hints(api.RunStatus)) - {"stale"}  # every optional key present
    body = live.json()
    assert body["failure"] == {"rule": "stalled", "reason": "no step"} and body["replica_versions"] == {
        "r0": 3,
        "r1": 2,
    }
    assert body["dead_letters"] == {"tasks": {"attempts": 2}, "rollouts": {"oversize": 1}}
    assert body["staleness"] == {"staleness_mean": 0.5, "staleness_peak": 1.0, "dropped_stale": 4.0}
    assert body["evals"] == {"0": 0.4} and body["policy_evals"] == {"0": 0.6}
    assert stale.status_code == 200
    assert {k: v for k, v in stale.json().items() if k != "stale"} == expected
    assert set(stale.json()["stale"]) == {"read_unix_ms", "reason", "age_seconds"}
