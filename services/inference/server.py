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
from shared.runtime.service_lifecycle import Api, Listen, ServiceLifecycle, serve_service
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
    if settings.exact and settings.pool in ("rollouts", "policy_eval"):
        options["exact"] = True
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


class InferenceService(ServiceLifecycle):
    """A replica on the one lifecycle: `setup` loads its model and builds what its kind serves (a
    rollout replica: the rollout loop, the weights, the heartbeat, the agent endpoint; a teacher or
    judge pool's replica: its RPCs on fixed weights; a judge's reward model: Judge without an
    engine); `close` releases them, an engine it loaded last."""

    name = "inference"

    def __init__(self, settings: InferenceSettings, engine: Engine | None = None, parts: ReplicaParts | None = None):
        self.settings = settings
        self.engine = engine  # an engine handed in outlives this replica
        self.parts = parts or ReplicaParts()
        self.worker: RolloutWorker | None = None
        self.resources = contextlib.AsyncExitStack()

    def listen(self) -> Listen:
        return self.settings.listen()

    async def setup(self) -> Api:
        from shared.models import load_tokenizer

        s = self.settings
        bind_default_executor(s.torch_threads)
        with loading("inference", s.metrics_port, s.host, s.run_id, s.pool):
            classifier = await asyncio.to_thread(reward_model, s)
            if classifier is None and self.engine is None:
                self.engine = await asyncio.to_thread(load_engine, s)
                self.resources.callback(self.engine.close)
        if classifier is not None:
            return self.api(reward_model_servicer(s, classifier), classifier, traces=False)
        redis = s.redis()
        self.resources.push_async_callback(redis.aclose)
        tokenizer = load_tokenizer(s.model_path)
        POLICY_VERSION.labels(s.replica_id, s.pool).set(self.engine.version)
        if s.pool in FIXED_POOLS:  # fixed weights, no task: it answers Score / Judge until stopped
            queue = WorkQueue(redis, s.run_id, pool="rollouts")  # whose pending tasks Status reports
            traces = s.return_routing_traces and self.engine.capabilities.routing_trace
            return self.api(engine_servicer(s, self.engine, tokenizer, queue), self.engine, traces)
        queue = WorkQueue(redis, s.run_id, pool=s.pool)
        self.worker = await self.rollout_worker(tokenizer, queue)
        return self.api(
            engine_servicer(s, self.engine, tokenizer, queue, self.worker), self.engine, self.worker.return_traces
        )

    async def rollout_worker(self, tokenizer, queue: WorkQueue) -> RolloutWorker:
        """A rollout (or policy_eval) replica's loop, with the reward process, the pools' clients and
        the agent endpoint it uses."""
        s, engine = self.settings, self.engine
        rewards = RewardRunner(s.tasks.reward_timeout_seconds, s.tasks.reward_retries)
        self.resources.callback(rewards.close)
        teacher, judge = pool_client(s, "teacher"), pool_client(s, "judge")
        for client in (teacher, judge):
            if client is not None:
                self.resources.push_async_callback(client.close)
        if s.agent.endpoint:
            self.parts.endpoint = await self.resources.enter_async_context(served_endpoint(engine, tokenizer, s))
        return RolloutWorker(
            engine,
            tokenizer,
            queue,
            s,
            rewards,
            teacher=TeacherScoring(teacher, s.teacher.top_k, s.teacher.batch_sequences, engine.vocab_size)
            if teacher
            else None,
            judging=JudgeScoring(judge, s.judge.templates, rewards),
            endpoint=self.parts.endpoint,
        )

    def api(self, servicer: InferenceServicer, model: Engine | SequenceClassifier, traces: bool) -> Api:
        return Api(
            [(inference_pb2_grpc.add_InferenceServicer_to_server, servicer)],
            ["steadyrl.v1.Inference"],
            {
                "replica": self.settings.replica_id,
                "engine": model.name,
                "device": getattr(model, "device", "cpu"),
                "traces": traces,
            },
        )

    def loops(self, stop: asyncio.Event) -> dict:
        s = self.settings
        if self.worker is None:  # a pool's replica: its RPCs until stopped
            return {"pool": stop.wait()}
        loops = {"rollouts": self.worker.run(stop)}
        if s.weightsync_address:
            loops["weights"] = weights_loop(s, self.engine, stop, self.worker.version_changed)
        if s.orchestrator_address:
            loops["heartbeat"] = heartbeat(s, self.engine, self.worker, stop)
        return loops

    async def close(self) -> None:
        await self.resources.aclose()


async def serve(
    settings: InferenceSettings,
    engine: Engine | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    parts: ReplicaParts | None = None,
) -> None:
    """Run the replica until `stop` is set (or forever); `parts` are filled in before `ready` is set."""
    await serve_service(InferenceService(settings, engine, parts), ready, stop)
