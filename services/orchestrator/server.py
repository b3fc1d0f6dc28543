"""Orchestrator process: the FastAPI control plane, the gRPC Orchestrator service and the loop."""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from redis.asyncio import Redis

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.orchestrator import Orchestrator
from shared.rpc import start_server
from shared.rpc.steadyrl.v1 import common_pb2, orchestrator_pb2_grpc
from shared.rpc.steadyrl.v1 import orchestrator_pb2 as pb

log = logging.getLogger("steadyrl.orchestrator")
REFUSED = Counter("steadyrl_orchestrator_auth_refused_total", "Requests refused for a missing or wrong token")

BEARER = HTTPBearer(auto_error=False)
ACTIONS = {"start": ("created", "paused"), "pause": ("running",), "resume": ("paused",),
           "stop": ("created", "running", "paused")}
TARGET = {"start": "running", "pause": "paused", "resume": "running", "stop": "stopped"}


def create_app(orchestrator: Orchestrator, token: str | None) -> FastAPI:
    app = FastAPI(title="steadyrl orchestrator", version="1",
                  description="Control plane of one steadyrl run. Every route but /health and /metrics needs "
                              "`Authorization: Bearer <token>` when a token is configured.")
    def authorised(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> None:
        if token is None:
            return
        if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
            REFUSED.inc()
            raise HTTPException(status_code=401, detail="missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": str(exc)})

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/run", dependencies=[Depends(authorised)])
    async def status() -> dict:
        """State, versions of the trainer and of every replica, queue depths, progress, evals."""
        return await orchestrator.status()

    @app.get("/v1/run/config", dependencies=[Depends(authorised)])
    async def config() -> dict:
        """The resolved settings of this run (secrets left out)."""
        return orchestrator.settings.model_dump(mode="json", exclude={"token", "redis_url", "token_file"})

    @app.post("/v1/run/{action}", dependencies=[Depends(authorised)])
    async def act(action: str) -> dict:
        """start | pause | resume | stop the run."""
        if action not in ACTIONS:
            raise HTTPException(status_code=404, detail=f"unknown action {action!r}; one of {sorted(ACTIONS)}")
        state = await orchestrator.state()
        if state not in ACTIONS[action]:
            raise HTTPException(status_code=409, detail=f"cannot {action} a run that is {state}")
        await orchestrator.set_state(TARGET[action])
        return {"run_id": orchestrator.settings.run_id, "state": TARGET[action]}

    return app


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    async def Heartbeat(self, request, context):
        import grpc

        if not request.replica_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "replica_id is required")
        await self.orchestrator.redis.hset(self.orchestrator.replicas_key, request.replica_id, request.policy_version)
        return common_pb2.Empty()

    async def Status(self, request, context):
        status = await self.orchestrator.status()
        return pb.RunStatus(
            run_id=status["run_id"], state=status["state"], trainer_version=status["trainer_version"],
            replica_versions=status["replica_versions"], queue_pending=status["queue"]["pending"],
            queue_leased=status["queue"]["leased"], rollouts_pending=status["queue"]["rollouts"],
            tasks_dead_lettered=status["queue"]["dead"], epoch=status["epoch"],
        )


async def serve(settings: OrchestratorSettings, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    import uvicorn

    from shared.rpc.tls import tls_from_env, uvicorn_options

    stop = stop or asyncio.Event()
    redis = Redis.from_url(settings.redis_url.get_secret_value(), socket_timeout=30, health_check_interval=10)
    orchestrator = await asyncio.to_thread(Orchestrator, settings, redis)
    server, grpc_port, _ = await start_server(
        [(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, OrchestratorServicer(orchestrator))],
        ["steadyrl.v1.Orchestrator"], f"{settings.host}:{settings.grpc_port}")
    app = create_app(orchestrator, settings.bearer_token())
    http = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.http_port, log_level="warning",
                                         lifespan="off", **uvicorn_options(tls_from_env())))
    tasks = [asyncio.create_task(orchestrator.run(stop)), asyncio.create_task(http.serve())]
    while not http.started:
        await asyncio.sleep(0.02)
    log.info("event=started service=orchestrator run=%s http_port=%d grpc_port=%d auth=%s", settings.run_id,
             http.servers[0].sockets[0].getsockname()[1], grpc_port, settings.bearer_token() is not None)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        http.should_exit = True
        tasks[0].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop(grace=1.0)
        await orchestrator.close()
        await redis.aclose()
