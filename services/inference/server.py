"""Inference replica: the Inference gRPC API, the rollout loop and the weight subscriber."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from prometheus_client import Gauge, Histogram

from services.inference import trajectories
from services.inference.config import InferenceSettings
from services.inference.worker import RolloutWorker
from shared.engines import Engine, Sampling, make_engine
from shared.rollouts.record import trace_message
from shared.rpc.steadyrl.v1 import common_pb2, inference_pb2_grpc
from shared.rpc.steadyrl.v1 import inference_pb2 as pb
from shared.runstore.queues import WorkQueue
from shared.runtime.metrics import loading
from shared.runtime.service_main import grpc_service, run_loops
from shared.tasks import RewardRunner
from shared.weightsync.manifest import kind
from shared.weightsync.signing import verifier_of

log = logging.getLogger("steadyrl.inference")

POLICY_VERSION = Gauge(
    "steadyrl_inference_policy_version", "Policy version the engine serves (set once it serves)", ["replica", "pool"]
)
SWAP_SECONDS = Histogram(
    "steadyrl_inference_swap_seconds",
    "Generation paused while a version was applied",
    ["replica"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60),
)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self,
        settings: InferenceSettings,
        engine: Engine,
        tokenizer,
        queue: WorkQueue | None,
        worker: RolloutWorker | None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.queue = queue
        self.worker = worker

    async def _invalid(self, context, message: str, code=grpc.StatusCode.INVALID_ARGUMENT):
        await context.abort(code, message)

    async def Generate(self, request, context):
        if request.prompt_token_ids:
            prompt = list(request.prompt_token_ids)
            bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
            if bad:
                await self._invalid(
                    context, f"token ids {bad[:5]} outside the vocabulary [0, {self.engine.vocab_size})"
                )
        elif request.prompt_text:
            prompt = list(self.tokenizer(request.prompt_text).input_ids)
        else:
            await self._invalid(context, "give prompt_token_ids or prompt_text")
        try:
            sampling = Sampling.from_proto(request.sampling)
        except ValueError as exc:
            await self._invalid(context, str(exc))
        if sampling.max_new_tokens > self.settings.max_new_tokens_limit:
            await self._invalid(
                context,
                f"max_new_tokens {sampling.max_new_tokens} > limit {self.settings.max_new_tokens_limit}",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        if len(prompt) + sampling.max_new_tokens > self.engine.max_model_len:
            await self._invalid(
                context,
                f"prompt ({len(prompt)}) + max_new_tokens ({sampling.max_new_tokens}) > {self.engine.max_model_len}",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        if request.return_routing_trace and not self.engine.capabilities.routing_trace:
            await self._invalid(
                context,
                f"the {self.engine.name} engine returns no routing traces here",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_token(token: int, logprob: float, version: int) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (token, logprob, version))

        try:
            job = asyncio.wrap_future(self.engine.start(prompt, sampling, request.return_routing_trace, on_token))
        except ValueError as exc:
            await self._invalid(context, str(exc))
        try:
            while not (job.done() and events.empty()):
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                token, logprob, version = getter.result()
                yield pb.GenerateEvent(
                    token_id=token,
                    inference_logprob=logprob,
                    policy_version=version,
                    text=self.tokenizer.decode([token]),
                )
        finally:
            job.cancel()  # the client went away: the engine drops the sequence (or never starts it)
        sample = job.result()
        final = pb.GenerateEvent(
            token_id=-1, done=True, finish_reason=sample.finish_reason, policy_version=sample.versions[-1]
        )
        if sample.routing_trace is not None:
            final.routing_trace = trace_message(sample.routing_trace, sample.num_experts).SerializeToString()
        yield final

    async def Status(self, request, context):
        lag = 0
        if self.queue is not None:
            with contextlib.suppress(Exception):
                lag = await self.queue.pending_count()
        caps = self.engine.capabilities
        return pb.InferenceStatus(
            replica_id=self.settings.replica_id,
            engine=self.engine.name,
            model=self.engine.model_path,
            version=common_pb2.PolicyVersion(version=self.engine.version),
            capabilities=pb.EngineCapabilities(
                routing_trace=caps.routing_trace, logprobs=caps.logprobs, hot_swap=caps.hot_swap, dtype=caps.dtype
            ),
            queue_lag=lag,
            rollouts_published=self.worker.published if self.worker else 0,
            tokens_per_second=self.worker.tokens_per_second if self.worker else 0.0,
            busy=bool(self.worker and self.worker.busy),
        )


async def heartbeat(settings: InferenceSettings, engine: Engine, worker: RolloutWorker, stop: asyncio.Event) -> None:
    """Report this replica's version to the orchestrator every second, and as soon as it serves a
    new one (best effort)."""
    from shared.rpc import channel_options
    from shared.rpc.auth import channel as auth_channel
    from shared.rpc.steadyrl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    async with auth_channel(settings.orchestrator_address, options=channel_options()) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        while not stop.is_set():
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Heartbeat(
                    orchestrator_pb2.ReplicaHeartbeat(
                        replica_id=settings.replica_id,
                        service="inference",
                        policy_version=engine.version,
                        address=f"{settings.host}:{settings.port}",
                        tokens_per_second=worker.tokens_per_second,
                    ),
                    timeout=2,
                )
            reported = engine.version
            for _ in range(10):  # a second, or less once a new version is served
                await asyncio.sleep(0.1)
                if engine.version != reported:
                    break


def engine_options(settings: InferenceSettings) -> dict:
    """What `make_engine` gets beyond the path and dtype."""
    options: dict = {
        "max_num_seqs": settings.max_num_seqs,
        "update_mode": settings.update_mode,
        **settings.quantization_options(),
    }
    if settings.engine == "torch" and settings.torch_threads:
        options["threads"] = settings.torch_threads
    if settings.engine == "torch" and settings.gpus_per_replica:
        options["device"] = "cuda"
    if settings.engine == "vllm":
        options.update(
            max_model_len=settings.vllm_max_model_len,
            kv_cache_gib=settings.vllm_kv_cache_gib,
            gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
            tensor_parallel_size=max(settings.gpus_per_replica, 1),
            lora_rank=settings.lora_rank,
            lora_targets=tuple(settings.lora_targets),
        )
    return options


def load_engine(settings: InferenceSettings) -> Engine:
    return make_engine(settings.engine, settings.model_path, settings.dtype, **engine_options(settings))


async def serve_agents(engine: Engine, tokenizer, settings: InferenceSettings):
    """The agent endpoint (`services.inference.agents`) on a free loopback port: (its uvicorn
    server, the task serving it)."""
    import uvicorn

    from services.inference.agents import Endpoint

    endpoint = Endpoint(engine, tokenizer, "", settings.agent_isolation_of(), settings.agent_max_body_bytes)
    server = uvicorn.Server(
        uvicorn.Config(endpoint.app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            raise RuntimeError(f"the agent endpoint did not start: {serving.exception()!r}")
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    endpoint.base_url = f"http://127.0.0.1:{port}"
    trajectories.ENDPOINT[:] = [endpoint]
    log.info("event=agent_endpoint url=%s", endpoint.base_url)
    return server, serving


async def serve(
    settings: InferenceSettings,
    engine: Engine | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the replica until `stop` is set (or forever)."""
    from shared.models import load_tokenizer
    from shared.weightsync.subscriber import WatchSubscriber

    owned = engine is None  # an engine handed in outlives this replica
    with loading("inference", settings.metrics_port, settings.host, settings.run_id, settings.pool):
        engine = engine or await asyncio.to_thread(load_engine, settings)
    tokenizer = load_tokenizer(settings.model_path)
    replica = settings.replica_id
    stop = stop or asyncio.Event()
    redis = settings.redis()
    queue = WorkQueue(redis, settings.run_id, pool=settings.pool)
    rewards = RewardRunner(settings.reward_timeout_seconds)
    worker = RolloutWorker(
        engine,
        tokenizer,
        queue,
        replica,
        settings.lease_seconds,
        settings.tasks_per_batch,
        settings.idle_poll_seconds,
        settings.return_routing_traces,
        rewards,
        settings.version_wait_seconds,
        settings.max_inflight_tasks,
        settings.batching,
    )
    servicer = InferenceServicer(settings, engine, tokenizer, queue, worker)
    POLICY_VERSION.labels(replica, settings.pool).set(engine.version)
    loops = {"rollouts": worker.run(stop)}
    if settings.weightsync_address:

        async def apply(delivery) -> float:
            seconds = await asyncio.to_thread(engine.apply, delivery)
            POLICY_VERSION.labels(replica, settings.pool).set(engine.version)
            SWAP_SECONDS.labels(replica).observe(seconds)
            log.info(
                "event=weights_applied version=%d transport=%s kind=%s paused_seconds=%.4f",
                delivery.version,
                delivery.transport,
                kind(delivery.manifest),
                seconds,
            )
            return seconds

        subscriber = WatchSubscriber(
            settings.weightsync_address,
            apply,
            replica,
            settings.max_message_bytes,
            transports=settings.weight_transports,
            base=engine.weight_bytes,
            version=engine.version,
            verifier=verifier_of(settings, settings.run_id),
        )
        loops["weights"] = subscriber.run(stop)
    if settings.orchestrator_address:
        loops["heartbeat"] = heartbeat(settings, engine, worker, stop)
    endpoint = await serve_agents(engine, tokenizer, settings) if settings.agent_endpoint else None
    try:
        async with grpc_service(
            "inference",
            [(inference_pb2_grpc.add_InferenceServicer_to_server, servicer)],
            ["steadyrl.v1.Inference"],
            settings.host,
            settings.port,
            settings.max_message_bytes,
            settings.metrics_port,
            ready,
            run=settings.run_id,
            replica=replica,
            engine=engine.name,
            device=getattr(engine, "device", "cpu"),
            traces=worker.return_traces,
        ) as serving:
            await run_loops(loops, stop, serving.health)
    finally:
        if endpoint is not None:
            trajectories.ENDPOINT.clear()
            endpoint[0].should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(endpoint[1], 5)
        await redis.aclose()
        rewards.close()
        if owned:
            engine.close()
