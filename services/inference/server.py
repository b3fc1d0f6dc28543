"""An inference replica, assembled: its engine (`load_engine`), the rollout loop
(`worker.py`), the weights (`weights.py`), the heartbeat (`heartbeat.py`), the agent endpoint
(`agents.py`), the teacher and judge pools' clients (`teacher.py`, `judge.py`) and the gRPC API
(`servicer.py`), until stopped. A teacher or judge pool's replica runs only the gRPC API, on fixed
weights (a judge's reward model without an engine)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from services.inference.agents import Endpoint, served_endpoint
from services.inference.config import InferenceSettings
from services.inference.heartbeat import heartbeat
from services.inference.judge import JudgeScoring
from services.inference.metrics import POLICY_VERSION
from services.inference.servicer import InferenceServicer, engine_servicer, reward_model_servicer
from services.inference.teacher import TeacherScoring
from services.inference.weights import weights_loop
from services.inference.worker import RolloutWorker
from shared.engines import Engine, make_engine
from shared.engines.classifier import SequenceClassifier, is_classifier
from shared.rpc.pool_client import PoolClient
from shared.rpc.steadyrl.v1 import inference_pb2_grpc
from shared.runstore.queues import WorkQueue
from shared.runtime.metrics import loading
from shared.runtime.service_main import grpc_service, run_loops
from shared.runtime.torch_threads import bind_default_executor
from shared.tasks import RewardRunner

log = logging.getLogger("steadyrl.inference")


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
            max_model_len=settings.vllm.max_model_len,
            kv_cache_gib=settings.vllm.kv_cache_gib,
            gpu_memory_utilization=settings.vllm.gpu_memory_utilization,
            tensor_parallel_size=max(settings.gpus_per_replica, 1),
            lora_rank=settings.lora.rank,
            lora_targets=tuple(settings.lora.targets),
        )
    return options


def load_engine(settings: InferenceSettings) -> Engine:
    return make_engine(settings.engine, settings.model_path, settings.dtype, **engine_options(settings))


FIXED_POOLS = ("teacher", "judge")  # replicas on fixed weights that serve no task, only their RPC


def pool_client(settings: InferenceSettings, pool: str) -> PoolClient | None:
    """A rollout replica's client of the teacher or judge pool (None without one)."""
    section = getattr(settings, pool)
    if not section.addresses:
        return None
    return PoolClient(
        pool,
        section.addresses,
        inference_pb2_grpc.InferenceStub,
        section.timeout_seconds,
        section.attempts,
        ready_seconds=section.ready_seconds,
    )


def reward_model(settings: InferenceSettings) -> SequenceClassifier | None:
    """A judge pool's replica serving a sequence-classification model loads it in place of an engine."""
    if settings.pool != "judge" or not is_classifier(settings.model_path):
        return None
    return SequenceClassifier(settings.model_path, settings.dtype, settings.torch_threads)


@dataclass
class ReplicaParts:
    """A rollout replica's parts, for a caller that serves it in its own process (tests): `serve` fills them in
    before it sets `ready`."""

    endpoint: Endpoint | None = None
    """The agent endpoint, where the replica serves one."""


async def serve(
    settings: InferenceSettings,
    engine: Engine | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    parts: ReplicaParts | None = None,
) -> None:
    """Run the replica until `stop` is set (or forever)."""
    from shared.models import load_tokenizer

    owned = engine is None  # an engine handed in outlives this replica
    bind_default_executor(settings.torch_threads)
    stop = stop or asyncio.Event()
    with loading("inference", settings.metrics_port, settings.host, settings.run_id, settings.pool):
        classifier = await asyncio.to_thread(reward_model, settings)
        if classifier is None:
            engine = engine or await asyncio.to_thread(load_engine, settings)
    if classifier is not None:
        await serve_reward_model(settings, classifier, ready, stop)
        return
    try:
        tokenizer = load_tokenizer(settings.model_path)
        if settings.pool in FIXED_POOLS:
            await serve_pool(settings, engine, tokenizer, ready, stop)
        else:
            await serve_rollouts(settings, engine, tokenizer, ready, stop, parts or ReplicaParts())
    finally:
        if owned:
            engine.close()


async def serve_rollouts(
    settings: InferenceSettings,
    engine: Engine,
    tokenizer,
    ready: asyncio.Event | None,
    stop: asyncio.Event,
    parts: ReplicaParts,
) -> None:
    """A rollout (or policy_eval) replica: the rollout loop, the weights, the heartbeat, the agent endpoint and the
    gRPC API until stopped."""
    async with contextlib.AsyncExitStack() as stack:
        redis = settings.redis()
        stack.push_async_callback(redis.aclose)
        queue = WorkQueue(redis, settings.run_id, pool=settings.pool)
        rewards = RewardRunner(settings.tasks.reward_timeout_seconds, settings.tasks.reward_retries)
        stack.callback(rewards.close)
        teacher = pool_client(settings, "teacher")
        judge = pool_client(settings, "judge")
        for client in (teacher, judge):
            if client is not None:
                stack.push_async_callback(client.close)
        if settings.agent.endpoint:
            parts.endpoint = await stack.enter_async_context(served_endpoint(engine, tokenizer, settings))
        worker = RolloutWorker(
            engine,
            tokenizer,
            queue,
            settings,
            rewards,
            teacher=TeacherScoring(teacher, settings.teacher.top_k, settings.teacher.batch_sequences, engine.vocab_size)
            if teacher
            else None,
            judging=JudgeScoring(judge, settings.judge.templates, rewards),
            endpoint=parts.endpoint,
        )
        POLICY_VERSION.labels(settings.replica_id, settings.pool).set(engine.version)
        loops = {"rollouts": worker.run(stop)}
        if settings.weightsync_address:
            loops["weights"] = weights_loop(settings, engine, stop, worker.version_changed)
        if settings.orchestrator_address:
            loops["heartbeat"] = heartbeat(settings, engine, worker, stop)
        servicer = engine_servicer(settings, engine, tokenizer, queue, worker)
        async with serving_api(settings, servicer, ready, engine, worker.return_traces) as serving:
            await run_loops(loops, stop, serving.health)


async def serve_pool(
    settings: InferenceSettings, engine: Engine, tokenizer, ready: asyncio.Event | None, stop: asyncio.Event
) -> None:
    """A teacher or judge pool's replica: fixed weights, no task; it answers Score / Judge until stopped."""
    redis = settings.redis()
    try:
        queue = WorkQueue(redis, settings.run_id, pool="rollouts")  # whose pending tasks Status reports
        servicer = engine_servicer(settings, engine, tokenizer, queue)
        POLICY_VERSION.labels(settings.replica_id, settings.pool).set(engine.version)
        traces = settings.return_routing_traces and engine.capabilities.routing_trace
        async with serving_api(settings, servicer, ready, engine, traces) as serving:
            await run_loops({"pool": stop.wait()}, stop, serving.health)
    finally:
        await redis.aclose()


async def serve_reward_model(
    settings: InferenceSettings, classifier: SequenceClassifier, ready: asyncio.Event | None, stop: asyncio.Event
) -> None:
    """A judge pool's replica on a reward model: the Judge and Status RPCs until stopped."""
    async with serving_api(settings, reward_model_servicer(settings, classifier), ready, classifier, False) as serving:
        await run_loops({"pool": stop.wait()}, stop, serving.health)


def serving_api(
    settings: InferenceSettings,
    servicer: InferenceServicer,
    ready: asyncio.Event | None,
    model: Engine | SequenceClassifier,
    traces: bool,
):
    """The replica's gRPC API and /metrics while open (`ready` set once both listen)."""
    return grpc_service(
        "inference",
        [(inference_pb2_grpc.add_InferenceServicer_to_server, servicer)],
        ["steadyrl.v1.Inference"],
        settings.host,
        settings.port,
        settings.max_message_bytes,
        settings.metrics_port,
        ready,
        run=settings.run_id,
        replica=settings.replica_id,
        engine=model.name,
        device=getattr(model, "device", "cpu"),
        traces=traces,
    )
