"""Hypothesis over every gRPC method of every service: random (well-typed, arbitrary-valued)
requests get a result or a deliberate status — never INTERNAL/UNKNOWN — and every server stays
healthy. The services run with a bearer token: every method refuses a caller without it and one
with a wrong token (UNAUTHENTICATED), while health stays open. Counts are printed (-s)."""

import asyncio

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.inference.config import InferenceSettings
from services.inference.server import serve as serve_inference
from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.server import serve as serve_orchestrator
from services.trainer.config import TrainerSettings
from services.trainer.server import serve as serve_trainer
from services.weightsync.config import WeightSyncSettings
from services.weightsync.server import serve as serve_weightsync
from shared.rpc.steadyrl.v1 import inference_pb2, orchestrator_pb2, trainer_pb2, weightsync_pb2
from shared.runstore.redis_server import free_port
from tests.helpers import weight_keys

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
SCALARS = {
    F.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    F.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    F.TYPE_UINT32: st.integers(0, 2**32 - 1),
    F.TYPE_UINT64: st.integers(0, 2**64 - 1),
    F.TYPE_FLOAT: st.floats(width=32),
    F.TYPE_DOUBLE: st.floats(),
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: st.text(max_size=20),
    F.TYPE_BYTES: st.binary(max_size=64),
}


def message(descriptor, cls, depth: int = 0):
    """Messages of `cls` with random values in every field (nested up to depth 2)."""
    fields = {}
    for field in descriptor.fields:
        if field.type == F.TYPE_MESSAGE:
            if depth >= 2 or field.message_type.GetOptions().map_entry:
                continue
            inner = message(field.message_type, None, depth + 1)
        elif field.type == F.TYPE_ENUM:
            inner = st.sampled_from([v.number for v in field.enum_type.values])
        else:
            inner = SCALARS[field.type]
        is_repeated = getattr(field, "is_repeated", None)
        repeated = is_repeated if isinstance(is_repeated, bool) else field.label == F.LABEL_REPEATED
        fields[field.name] = st.lists(inner, max_size=4) if repeated else inner
    optional = st.fixed_dictionaries({}, optional=fields)
    if cls is None:
        return optional
    return optional.map(lambda values: cls(**values))


def methods(module, service: str):
    descriptor = module.DESCRIPTOR.services_by_name[service]
    for method in descriptor.methods:
        request = getattr(module, method.input_type.name, None)
        if request is None:
            from shared.rpc.steadyrl.v1 import common_pb2

            request = getattr(common_pb2, method.input_type.name)
        reply = getattr(module, method.output_type.name, None)
        if reply is None:
            from shared.rpc.steadyrl.v1 import common_pb2

            reply = getattr(common_pb2, method.output_type.name)
        yield method, request, reply


TOKEN = "fuzz-token"
ENDLESS = {"Watch"}  # streams until the caller leaves: every example ends at its deadline, so a short one


def stub_call(channel, path: str, method, request_cls, reply_cls):
    kind = "stream_unary" if method.client_streaming else "unary_stream" if method.server_streaming else "unary_unary"
    return getattr(channel, kind)(
        path, request_serializer=request_cls.SerializeToString, response_deserializer=reply_cls.FromString
    )


async def invoke(call, method, request, timeout: float):
    if method.client_streaming:

        async def stream():
            for item in request:
                yield item

        return await call(stream(), timeout=timeout)
    if method.server_streaming:
        return [reply async for reply in call(request, timeout=timeout)]
    return await call(request, timeout=timeout)


def test_random_requests_to_every_method(tmp_path, tiny_model_dir, redis_server, run_id, monkeypatch):
    from shared.rpc.auth import channel as auth_channel

    monkeypatch.setenv("STEADYRL_TOKEN", TOKEN)  # every service requires it, as deployed
    ports = {name: free_port() for name in ("weightsync", "inference", "trainer", "orchestrator")}
    targets = [
        (weightsync_pb2, "WeightSync", "weightsync"),
        (inference_pb2, "Inference", "inference"),
        (trainer_pb2, "Trainer", "trainer"),
        (orchestrator_pb2, "Orchestrator", "orchestrator"),
    ]
    calls: dict[str, int] = {}

    async def main():
        stop = asyncio.Event()
        servers = [
            serve_weightsync(
                WeightSyncSettings(
                    port=ports["weightsync"],
                    metrics_port=0,
                    spill_dir=tmp_path / "s",
                    verify_key_file=weight_keys(tmp_path)[1],
                ),
                stop=stop,
            ),
            serve_inference(
                InferenceSettings(
                    port=ports["inference"],
                    metrics_port=0,
                    model_path=str(tiny_model_dir),
                    dtype="float32",
                    redis_url=redis_server.url,
                    run_id=run_id,
                ),
                stop=stop,
            ),
            serve_trainer(
                TrainerSettings(
                    port=ports["trainer"],
                    metrics_port=0,
                    model_path=str(tiny_model_dir),
                    out_dir=tmp_path / "t",
                    redis_url=redis_server.url,
                    run_id=run_id,
                ),
                stop=stop,
            ),
            serve_orchestrator(
                OrchestratorSettings(
                    grpc_port=ports["orchestrator"],
                    http_port=0,
                    model_path=str(tiny_model_dir),
                    redis_url=redis_server.url,
                    run_id=run_id,
                    out_dir=tmp_path / "o",
                ),
                stop=stop,
            ),
        ]
        tasks = [asyncio.create_task(s) for s in servers]
        channels = {name: auth_channel(f"127.0.0.1:{port}", token=TOKEN) for name, port in ports.items()}
        for channel in channels.values():
            await asyncio.wait_for(channel.channel_ready(), 120)
        return stop, tasks, channels

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # grpc.aio builds calls against the current loop
    stop, tasks, channels = loop.run_until_complete(main())
    try:
        for module, service, name in targets:
            for method, request_cls, reply_cls in methods(module, service):
                call = stub_call(
                    channels[name], f"/steadyrl.v1.{service}/{method.name}", method, request_cls, reply_cls
                )
                strategy = message(request_cls.DESCRIPTOR, request_cls)
                if method.client_streaming:
                    strategy = st.lists(strategy, max_size=3)

                def make(call, method, strategy):
                    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
                    @given(strategy)
                    def fuzz(request):
                        loop.run_until_complete(once(request, call, method))

                    return fuzz

                async def once(request, call, method):
                    try:
                        timeout = 0.5 if method.name in ENDLESS else 2 if method.server_streaming else 5
                        await invoke(call, method, request, timeout)
                        calls["OK"] = calls.get("OK", 0) + 1
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() in ALLOWED, (method.full_name, exc.code(), exc.details())
                        calls[exc.code().name] = calls.get(exc.code().name, 0) + 1

                make(call, method, strategy)()
        refused = 0
        for module, service, name in targets:  # and every method refuses a missing or a wrong token
            for token in ("", "wrong-token"):

                async def refuse(token=token, module=module, service=service, name=name):
                    count = 0
                    async with auth_channel(f"127.0.0.1:{ports[name]}", token=token) as bare:
                        for method, request_cls, reply_cls in methods(module, service):
                            call = stub_call(
                                bare, f"/steadyrl.v1.{service}/{method.name}", method, request_cls, reply_cls
                            )
                            request = [request_cls()] if method.client_streaming else request_cls()
                            with pytest.raises(grpc.aio.AioRpcError) as err:
                                await invoke(call, method, request, 5)
                            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, method.full_name
                            count += 1
                        reply = await health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest())
                        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # health stays open
                    return count

                refused += loop.run_until_complete(refuse())
        for name, channel in channels.items():

            async def check(channel=channel):
                return await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())

            reply = loop.run_until_complete(check())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    finally:
        stop.set()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        for channel in channels.values():
            loop.run_until_complete(channel.close())
        asyncio.set_event_loop(None)
        loop.close()
    methods_total = sum(len(module.DESCRIPTOR.services_by_name[service].methods) for module, service, _ in targets)
    print({"inputs": sum(calls.values()), "by_status": calls, "methods": methods_total, "auth_refused": refused})
    assert calls.get("OK", 0) > 0 and sum(calls.values()) - calls.get("OK", 0) > 0
    assert refused == 2 * methods_total
