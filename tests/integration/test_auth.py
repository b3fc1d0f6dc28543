"""The bearer token on gRPC: a weight-sync process with STEADYRL_TOKEN refuses every method to a
caller without it (UNAUTHENTICATED, counted) — reflection's listing of the services and the
collective's rendezvous included — serves one that has it, and keeps health open."""

import asyncio
import os
import subprocess
import sys

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.rpc.auth import channel
from shared.rpc.steadyrl.v1 import common_pb2, weightsync_pb2_grpc
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.runstore.redis_server import free_port
from shared.weightsync.grpc import GrpcWeightPublisher
from tests.helpers import pull_all, weight_keys

TOKEN = "a-long-random-token"


def refused(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    lines = [x for x in text.splitlines() if x.startswith("steadyrl_rpc_auth_refused_total{")]
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines)


def refused_streams(address: str, token: str) -> list[grpc.StatusCode]:
    """The codes of the two calls that stream requests (Push, reflection's listing), made with the
    sync API: grpc.aio's client can report INTERNAL for a write that races the server's refusal
    instead of the server's status (grpc/grpc#36066), which the sync client reports as sent."""
    metadata = [("authorization", f"Bearer {token}")] if token else []
    codes = []
    with grpc.insecure_channel(address) as ch:
        calls = (
            lambda: weightsync_pb2_grpc.WeightSyncStub(ch).Push(
                iter([pb.PushRequest(manifest=pb.WeightManifest(version=1))]), metadata=metadata, timeout=20
            ),
            lambda: list(
                reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=20
                )
            ),
        )
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            codes.append(err.value.code())
    return codes


def test_every_method_needs_the_token_but_health(tmp_path, monkeypatch):
    port = free_port()
    metrics = free_port()
    signer, public = weight_keys(tmp_path)
    env = {
        **os.environ,
        "STEADYRL_TOKEN": TOKEN,
        "STEADYRL_WEIGHTSYNC_PORT": str(port),
        "STEADYRL_WEIGHTSYNC_METRICS_PORT": str(metrics),
        "STEADYRL_WEIGHTSYNC_SPILL_DIR": str(tmp_path),
        "STEADYRL_WEIGHTSYNC_VERIFY_KEY_FILE": str(public),
    }
    server = subprocess.Popen([sys.executable, "-m", "services.weightsync"], env=env)
    address = f"127.0.0.1:{port}"

    async def main():
        codes = []
        for token in ("", "wrong-token"):
            async with channel(address, token=token) as ch:
                await ch.channel_ready()
                stub = weightsync_pb2_grpc.WeightSyncStub(ch)

                calls = [
                    stub.Latest(common_pb2.Empty()),
                    stub.List(common_pb2.Empty()),
                    stub.RendezvousPut(pb.RendezvousKey(epoch=1, key="0", value=b"10.0.0.9:1")),
                ]
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    codes.append(err.value.code())
                for stream in (stub.Pull(pb.PullRequest(version=1)), stub.Watch(pb.WatchRequest())):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        _ = [m async for m in stream]
                    codes.append(err.value.code())
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            codes += await asyncio.to_thread(refused_streams, address, token)
        publisher = GrpcWeightPublisher(address, signer)  # the token comes from the environment, as in a service
        await publisher.push({"w": torch.ones(4)}, 1)
        await publisher.close()
        manifest, payloads, _ = await asyncio.to_thread(pull_all, address, 1)  # the sync pull, token from env
        async with channel(address) as ch:
            replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            services = [s.name async for r in replies for s in r.list_services_response.service]
        return codes, manifest, payloads, services

    monkeypatch.setenv("STEADYRL_TOKEN", TOKEN)
    try:
        codes, manifest, payloads, services = asyncio.run(asyncio.wait_for(main(), 60))
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 14
        assert manifest.version == 1 and bytes(payloads[0]) == torch.ones(4).numpy().tobytes()
        assert refused(metrics) == 14
        assert "steadyrl.v1.WeightSync" in services  # the token lists them
    finally:
        server.terminate()
        server.wait(20)
