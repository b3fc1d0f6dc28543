"""Orchestrator process: the FastAPI control plane, the gRPC Orchestrator service and the loop."""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Annotated, get_args

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from redis.asyncio import Redis

from services.orchestrator import api_models as api
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.control import RedisUnavailable
from services.orchestrator.orchestrator import Orchestrator, TransitionRefused
from shared.rpc import DEFAULT_MAX_MESSAGE_BYTES
from shared.rpc.http import BodyLimit
from shared.rpc.steadyrl.v1 import common_pb2, orchestrator_pb2_grpc
from shared.rpc.steadyrl.v1 import orchestrator_pb2 as pb
from shared.runtime.metrics import registry_of
from shared.runtime.service_lifecycle import Api, Listen, ServiceLifecycle, serve_service

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("steadyrl.orchestrator")
REFUSED = Counter("steadyrl_orchestrator_auth_refused_total", "Requests refused for a missing or wrong token")

BEARER = HTTPBearer(auto_error=False)
ACTIONS = get_args(api.Action)
# `action` is declared to the schema, not to FastAPI: an unknown one gets 404 naming the actions, not a 422
ACTION = {
    "name": "action",
    "in": "path",
    "required": True,
    "description": "The transition; any other is refused with 404.",
    "schema": {"title": "Action", "type": "string", "enum": list(ACTIONS)},
}


def create_app(orchestrator: Orchestrator, token: str | None, max_request_bytes: int = 1 << 20) -> FastAPI:
    app = FastAPI(
        title="steadyrl orchestrator",
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        description="Control plane of one steadyrl run. Every route but /health and /metrics needs "
        "`Authorization: Bearer <token>` when a token is configured (the OpenAPI "
        "document and its pages too).",
        responses={413: api.TOO_LARGE},
    )

    def authorised(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> None:
        if token is None:
            return
        if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
            REFUSED.inc()
            raise HTTPException(
                status_code=401, detail="missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    app.add_middleware(BodyLimit, limit=max_request_bytes, setting="orchestrator.control.max_request_bytes")

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": str(exc)})

    @app.exception_handler(RedisUnavailable)
    async def unavailable(request: Request, exc: RedisUnavailable) -> JSONResponse:
        return JSONResponse(
            status_code=503,
            content={"detail": str(exc), "retry_after_seconds": exc.retry_after},
            headers={"Retry-After": str(exc.retry_after)},
        )

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:  # a bug: still JSON, and logged
        log.error("event=request_failed path=%s error=%r", request.url.path, exc)
        return JSONResponse(status_code=500, content={"detail": f"internal error: {type(exc).__name__}"})

    @app.get("/health", summary="Liveness", response_model=api.Health, response_description="The process is up.")
    async def health() -> dict:
        return {"ok": True}

    @app.get(
        "/metrics",
        summary="Prometheus metrics",
        response_class=Response,  # text, not JSON (its 413, as every route's, is JSON)
        responses={
            200: {"description": "Prometheus's text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}
        },
    )
    async def metrics() -> Response:
        return Response(generate_latest(registry_of(orchestrator.settings.run_id)), media_type=CONTENT_TYPE_LATEST)

    guarded = APIRouter(dependencies=[Depends(authorised)], responses={401: api.UNAUTHORISED})

    @guarded.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @guarded.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @guarded.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=app.title)

    @guarded.get(
        "/v1/run",
        summary="The run's status",
        response_model=api.RunStatus,
        response_description="The run's status (the last one read, marked `stale`, when Redis does not answer).",
        responses={
            503: api.unavailable("Redis did not answer in time and no status was read before (else: 200, `stale`).")
        },
    )
    async def status() -> dict:
        """State, versions of the trainer and of every replica, queue depths, progress, evals. When
        Redis does not answer in time: the last status read, with `stale` saying when and why."""
        return await orchestrator.bounded.status(orchestrator.status())

    @guarded.get(
        "/v1/run/config",
        summary="The run's settings",
        response_model=api.RunConfig,
        response_description="The resolved settings.",
    )
    async def config() -> dict:
        """The resolved settings of this run (secrets left out)."""
        return orchestrator.settings.model_dump(mode="json", exclude={"token", "redis_url", "token_file"})

    @guarded.post(
        "/v1/run/{action}",
        summary="Start, pause, resume or stop the run",
        response_model=api.ActionReply,
        response_description="The transition is applied.",
        responses={
            404: api.refusal(api.Error, "Not an action: `detail` names the four."),
            409: api.refusal(api.Error, "Not allowed from the run's state (named in `detail`)."),
            503: api.unavailable("Redis did not answer in time: the transition was not applied, and never will be."),
        },
        openapi_extra={"parameters": [ACTION]},
    )
    async def act(request: Request) -> dict:
        """start | pause | resume | stop the run (one atomic step each; stopped is final)."""
        action = request.path_params["action"]
        if action not in ACTIONS:
            raise HTTPException(status_code=404, detail=f"unknown action {action[:64]!r}; one of {sorted(ACTIONS)}")
        try:
            state = await orchestrator.transition(action)
        except TransitionRefused as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        return {"run_id": orchestrator.settings.run_id, "state": state}

    app.include_router(guarded)
    return app


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    async def Heartbeat(self, request, context):
        import grpc

        if not request.replica_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "replica_id is required")
        idle, uptime = request.idle_seconds, request.uptime_seconds
        if not (math.isfinite(idle) and math.isfinite(uptime) and 0 <= idle <= uptime + 1e-3):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"idle_seconds {idle} and uptime_seconds {uptime}: finite, 0 <= idle <= uptime",
            )
        await self._bounded(context, "heartbeat", self._record(request))
        return common_pb2.Empty()

    async def _record(self, request) -> None:
        """The replica's version, and its idle time when it reports one, in one round trip."""
        o = self.orchestrator
        async with o.redis.pipeline(transaction=False) as pipe:
            pipe.hset(o.keys.replicas, request.replica_id, request.policy_version)
            if request.uptime_seconds > 0:
                idle = f"{request.idle_seconds:.3f},{request.uptime_seconds:.3f}"
                pipe.hset(o.keys.replica_idle, request.replica_id, idle)
            await pipe.execute()

    async def Status(self, request, context):
        status = await self._bounded(context, "status", self.orchestrator.status())
        return pb.RunStatus(
            run_id=status["run_id"],
            state=status["state"],
            trainer_version=status["trainer_version"],
            replica_versions=status["replica_versions"],
            queue_pending=status["queue"]["pending"],
            queue_leased=status["queue"]["leased"],
            rollouts_pending=status["queue"]["rollouts"],
            tasks_dead_lettered=status["queue"]["dead"],
            epoch=status["epoch"],
        )

    async def _bounded(self, context, what: str, work):
        """`work` within the control plane's bound; UNAVAILABLE when Redis does not answer."""
        import grpc

        try:
            return await self.orchestrator.bounded.call(what, work)
        except RedisUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


class OrchestratorService(ServiceLifecycle):
    """The orchestrator on the service lifecycle: its loop and the HTTP control plane (under uvicorn)
    as loops beside the gRPC API; its /metrics is served on the HTTP port."""

    name = "orchestrator"

    def __init__(self, settings: OrchestratorSettings) -> None:
        self.settings = settings
        self.redis: Redis | None = None
        self.orchestrator: Orchestrator | None = None
        self.http: uvicorn.Server | None = None
        self.serving: asyncio.Task | None = None

    def listen(self) -> Listen:
        s = self.settings
        return Listen(s.host, s.grpc_port, DEFAULT_MAX_MESSAGE_BYTES, None, s.run_id)

    async def setup(self) -> Api:
        import uvicorn

        from shared.rpc.tls import tls_from_env, uvicorn_options

        s = self.settings
        self.redis = s.redis()
        self.orchestrator = await asyncio.to_thread(Orchestrator, s, self.redis)
        app = create_app(self.orchestrator, s.bearer_token(), s.control.max_request_bytes)
        self.http = uvicorn.Server(
            uvicorn.Config(
                app,
                host=s.host,
                port=s.http_port,
                log_level="warning",
                lifespan="off",
                **uvicorn_options(tls_from_env()),
            )
        )
        self.serving = asyncio.create_task(self.http.serve())
        while not self.http.started:
            if self.serving.done():  # the port is taken, TLS files are missing...
                raise RuntimeError(f"the HTTP control plane did not start: {self.serving.exception()!r}")
            await asyncio.sleep(0.02)
        return Api(
            [(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, OrchestratorServicer(self.orchestrator))],
            ["steadyrl.v1.Orchestrator"],
            {"http_port": self.http.servers[0].sockets[0].getsockname()[1], "auth": s.bearer_token() is not None},
        )

    def loops(self, stop: asyncio.Event) -> dict[str, Coroutine]:
        return {"orchestrator": self.orchestrator.run(stop), "http": _until(self.serving, stop)}

    async def close(self) -> None:
        if self.serving is not None:
            self.http.should_exit = True
            await asyncio.wait({self.serving}, timeout=10)
        if self.orchestrator is not None:
            await self.orchestrator.close()
        if self.redis is not None:
            await self.redis.aclose()


async def serve(
    settings: OrchestratorSettings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    await serve_service(OrchestratorService(settings), ready, stop)


async def _until(serving: asyncio.Task, stop: asyncio.Event) -> None:
    """The HTTP server as a loop: returning before `stop` means it died."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if serving.done() and not stop.is_set():
        serving.result()
