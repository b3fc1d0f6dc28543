"""The control plane when Redis freezes (a redis-server of its own, SIGSTOPped), and bodies too large."""

import asyncio
import os
import signal
import time

import grpc
import httpx
import pytest
from redis.asyncio import Redis

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.orchestrator import Orchestrator
from services.orchestrator.server import OrchestratorServicer, create_app
from shared.rpc.steadyrl.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from shared.runstore.redis_client import connect
from shared.runstore.redis_server import RedisServer

TOKEN = "s3cret-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def frozen_redis(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        yield server
        os.kill(server.process.pid, signal.SIGCONT)  # never leave it stopped


def test_a_frozen_redis_gives_stale_status_503_and_unavailable_and_applies_nothing_late(
    frozen_redis, run_id, tiny_model_dir, tmp_path
):
    """GET /v1/run answers the last status, marked stale; POST pause is refused with 503 (JSON,
    Retry-After) and is not applied when Redis thaws with the command in its socket; gRPC Status and
    Heartbeat answer UNAVAILABLE; once Redis answers, everything works again."""

    async def main():
        redis = connect(frozen_redis.url, timeout=5.0)
        settings = OrchestratorSettings(
            model_path=str(tiny_model_dir),
            redis_url=frozen_redis.url,
            run_id=run_id,
            out_dir=tmp_path,
            evals={"size": 5},
            control={"timeout_seconds": 1.0},
        )
        orchestrator = Orchestrator(settings, redis)
        await orchestrator.transition("start")
        server = grpc.aio.server()
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(OrchestratorServicer(orchestrator), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        transport = httpx.ASGITransport(app=create_app(orchestrator, TOKEN))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=HEADERS) as http:
            live = await http.get("/v1/run")
            assert live.status_code == 200 and "stale" not in live.json() and live.json()["state"] == "running"
            beat = orchestrator_pb2.ReplicaHeartbeat(replica_id="r1", idle_seconds=1.5, uptime_seconds=6.0)
            await stub.Heartbeat(beat, timeout=10)
            refused = []
            for idle, uptime in ((float("nan"), 6.0), (7.0, 6.0), (-1.0, 6.0)):  # idle only within uptime
                beat = orchestrator_pb2.ReplicaHeartbeat(replica_id="r1", idle_seconds=idle, uptime_seconds=uptime)
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await stub.Heartbeat(beat, timeout=10)
                refused.append(bad.value.code())
            assert refused == [grpc.StatusCode.INVALID_ARGUMENT] * 3
            assert await redis.hgetall(orchestrator.keys.replica_idle) == {b"r1": b"1.500,6.000"}
            await redis.hdel(orchestrator.keys.replicas, "r1")  # what follows counts r0's alone
            os.kill(frozen_redis.process.pid, signal.SIGSTOP)
            started = time.monotonic()
            stale = await http.get("/v1/run")
            pause = await http.post("/v1/run/pause")
            codes = []
            for call in (
                stub.Status(common_pb2.Empty(), timeout=10),
                stub.Heartbeat(orchestrator_pb2.ReplicaHeartbeat(replica_id="r0", policy_version=3), timeout=10),
            ):
                try:
                    await call
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            frozen_for = time.monotonic() - started
            await asyncio.sleep(max(0.0, 6.0 - frozen_for))  # past every deadline, then thaw
            os.kill(frozen_redis.process.pid, signal.SIGCONT)
            await asyncio.sleep(1.0)  # the pause script in Redis's socket runs now, past its deadline
            check = Redis.from_url(frozen_redis.url)
            state_after_thaw = (await check.hget(orchestrator.keys.run, "state")).decode()
            heartbeats = await check.hgetall(orchestrator.keys.replicas)
            await check.aclose()
            again = await http.get("/v1/run")
            paused = await http.post("/v1/run/pause")
        await channel.close()
        await server.stop(None)
        await orchestrator.close()
        await redis.aclose()
        return live.json(), stale, pause, codes, state_after_thaw, heartbeats, again, paused

    live, stale, pause, codes, state_after_thaw, heartbeats, again, paused = asyncio.run(asyncio.wait_for(main(), 90))
    assert stale.status_code == 200
    body = stale.json()
    assert body["stale"]["reason"] == "TimeoutError" and body["stale"]["age_seconds"] >= 0
    assert {k: v for k, v in body.items() if k != "stale"} == live  # the last status read, as it was
    assert pause.status_code == 503 and pause.headers["retry-after"] == "2"
    assert pause.json()["retry_after_seconds"] == 2 and "nothing was applied" in pause.json()["detail"]
    assert codes == [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    assert state_after_thaw == "running"  # refused, and not applied after the thaw either
    assert heartbeats in ({}, {b"r0": b"3"})  # a heartbeat is idempotent: it may land late
    assert again.status_code == 200 and "stale" not in again.json()
    assert paused.status_code == 200 and paused.json()["state"] == "paused"


def test_request_bodies_over_the_limit_are_refused_with_413(redis_server, run_id, tiny_model_dir, tmp_path):
    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = OrchestratorSettings(
            model_path=str(tiny_model_dir),
            redis_url=redis_server.url,
            run_id=run_id,
            out_dir=tmp_path,
            evals={"size": 5},
        )
        orchestrator = Orchestrator(settings, redis)
        transport = httpx.ASGITransport(app=create_app(orchestrator, TOKEN, max_request_bytes=4096))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=HEADERS) as http:
            declared = await http.post("/v1/run/start", content=b"x" * 4097)
            state = await orchestrator.state()
            small = await http.post("/v1/run/start", content=b"z" * 4096)
        await orchestrator.close()
        await redis.aclose()
        return declared, state, small

    declared, state, small = asyncio.run(asyncio.wait_for(main(), 30))
    assert declared.status_code == 413 and "over 4096 bytes" in declared.json()["detail"]
    assert state == "created"  # refused before the route ran
    assert small.status_code == 200 and small.json()["state"] == "running"


def test_a_streamed_body_is_cut_at_the_chunk_past_the_limit():
    """No Content-Length (chunked): the route reading it gets 413 at the chunk that crosses the
    limit, having read no more than that."""
    from fastapi import FastAPI, Request

    from shared.rpc.http import BodyLimit

    app = FastAPI()
    app.add_middleware(BodyLimit, limit=4096, setting="orchestrator.control.max_request_bytes")

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:

            async def chunks(n):
                for _ in range(n):
                    yield b"y" * 2048

            return await http.post("/echo", content=chunks(3)), await http.post("/echo", content=chunks(2))

    over, under = asyncio.run(main())
    assert over.status_code == 413 and over.json() == {
        "detail": "request body over 4096 bytes (orchestrator.control.max_request_bytes)"
    }
    assert under.status_code == 200 and under.json() == {"bytes": 4096}
