"""Only the run's trainer publishes weights: a well-formed version numbered past
the trainer's, pushed with the run's token but without the trainer's key, is refused by
weight-sync, and a replica behind a weight-sync that took it anyway refuses it too; the trainer's
next version is served as if nothing happened."""

import asyncio

import grpc
import pytest
import torch

from shared.models import load_causal_lm
from shared.rpc.steadyrl.v1 import common_pb2
from shared.weightsync.grpc import GrpcWeightPublisher
from shared.weightsync.manifest import CastView
from shared.weightsync.signing import Signer, write_key_pair
from tests.integration.test_inference import Replica, _version_is, wait_for


def weights(model_dir, scale: float) -> dict[str, torch.Tensor]:
    model = load_causal_lm(model_dir, "float32")
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return dict(CastView(model.state_dict(), torch.bfloat16))


def refused_versions() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("steadyrl_inference_weight_versions_refused_total", {"transport": "grpc"}) or 0.0


def test_weight_sync_refuses_a_version_the_trainer_did_not_sign(tmp_path, tiny_model_dir, redis_server, run_id):
    stranger = Signer.from_file(write_key_pair(tmp_path / "stranger")[0], run_id)

    async def main():
        async with Replica(tmp_path, tiny_model_dir, redis_server.url, run_id) as replica:
            address = f"127.0.0.1:{replica.ws_port}"
            codes = []
            for signer in (None, stranger):  # the token alone; a key of its own
                attacker = GrpcWeightPublisher(address, signer)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await attacker.push(weights(tiny_model_dir, 3.0), 16, 15)
                codes.append(err.value.code())
                await attacker.close()
            served = (await replica.stub.Status(common_pb2.Empty())).version.version
            trainer = GrpcWeightPublisher(address, replica.signer)
            await trainer.push(weights(tiny_model_dir, 1.1), 1, 0)
            await wait_for(lambda: _version_is(replica.stub, 1), 60)
            await trainer.close()
        return codes, served

    codes, served = asyncio.run(asyncio.wait_for(main(), 120))
    assert codes == [grpc.StatusCode.PERMISSION_DENIED] * 2 and served == 0


def test_a_replica_refuses_an_unsigned_version_a_weight_sync_took(tmp_path, tiny_model_dir, redis_server, run_id):
    """Weight-sync misconfigured to take unsigned versions: the replica still checks the trainer's
    signature and stays on what it serves."""

    async def main():
        async with Replica(
            tmp_path, tiny_model_dir, redis_server.url, run_id, ws_overrides={"unsigned_weights": True}
        ) as replica:
            address = f"127.0.0.1:{replica.ws_port}"
            before = refused_versions()
            attacker = GrpcWeightPublisher(address)
            await attacker.push(weights(tiny_model_dir, 3.0), 1, 0)
            await attacker.close()
            for _ in range(200):
                if refused_versions() > before:
                    break
                await asyncio.sleep(0.05)
            refused = refused_versions() - before
            served = (await replica.stub.Status(common_pb2.Empty())).version.version
            trainer = GrpcWeightPublisher(address, replica.signer)
            await trainer.push(weights(tiny_model_dir, 1.1), 2, 0)
            await wait_for(lambda: _version_is(replica.stub, 2), 60)
            await trainer.close()
        return refused, served

    refused, served = asyncio.run(asyncio.wait_for(main(), 120))
    assert refused == 1 and served == 0
