"""Adapter-only versions (trainer.lora.publish = "adapter"): a version is the LoRA adapter, its
manifest naming the base model by digest and carrying the adapter's config; each transport (gRPC,
a shared-memory file, a gloo broadcast, a gRPC delta) carries it to a replica's torch engine,
which puts peft's LoRA layers into its model once and writes each version into them in place —
the engine then computes what the trainer's adapted model computes. An adapter for another base,
of another rank, or whose tensors do not fit is refused with the reason, and the replica serves on
the version it had."""

import asyncio
import copy

import pytest
import torch

from shared.models import load_causal_lm
from shared.models.lora import adapter_config_json, adapter_state, apply_lora, base_digest
from shared.rpc.steadyrl.v1 import common_pb2
from shared.rpc.steadyrl.v1.weightsync_pb2 import AdapterInfo
from shared.weightsync import make_publisher
from shared.weightsync.manifest import CastView, describe
from tests.integration.test_inference import Replica, _version_is, wait_for
from tests.integration.test_weight_transports import received_by, refused_by, refused_more, subscribed

IDS = torch.tensor([[1, 7, 8, 9, 10, 11, 12]])


def adapted(model_dir, rank: int = 4, seed: int = 0):
    """The tiny model with a rank-`rank` adapter on q/v and the experts, B random (a trained one)."""
    model = apply_lora(load_causal_lm(model_dir, "float32"), rank, 2.0 * rank, 0.0, ["q_proj", "v_proj"], True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model.eval()


def version_of(model, digest: bytes) -> CastView:
    return CastView(
        adapter_state(model), torch.float32, AdapterInfo(base_digest=digest, config_json=adapter_config_json(model))
    )


def test_an_adapter_version_is_the_adapter_named_by_its_base(tiny_model_dir):
    model = adapted(tiny_model_dir)
    view = version_of(model, base_digest(str(tiny_model_dir)))
    manifest = describe(view, 3, 2)
    full = sum(p.numel() for p in load_causal_lm(tiny_model_dir, "float32").parameters())
    assert manifest.adapter.base_digest == base_digest(str(tiny_model_dir)) and len(manifest.adapter.base_digest) == 32
    assert all(s.name.startswith("base_model.model.") and ".lora_" in s.name for s in manifest.tensors)
    adapter_bytes = sum(s.nbytes for s in manifest.tensors)
    assert adapter_bytes == 4 * sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n) < 4 * full


def test_adapter_versions_reach_the_torch_engine_by_every_transport_and_bad_ones_are_refused(
    tmp_path, tiny_model_dir, redis_server, run_id
):
    digest = base_digest(str(tiny_model_dir))
    models = [adapted(tiny_model_dir, seed=s) for s in range(3)]
    delta = copy.deepcopy(models[2])  # version 4: version 3 but one tensor
    with torch.no_grad():
        next(p for n, p in delta.named_parameters() if ".lora_B." in n).mul_(1.5)
    with torch.no_grad():
        expected = [m(IDS).logits for m in [*models, delta]]
    other_base = version_of(models[0], bytes(32))
    other_rank = version_of(adapted(tiny_model_dir, rank=8), digest)
    misfit = version_of(adapted(tiny_model_dir, rank=8), digest)
    misfit.adapter = AdapterInfo(base_digest=digest, config_json=adapter_config_json(models[0]))  # says rank 4

    async def main():
        from services.weightsync.server import BYTES_PULLED

        ws = {"shm_dir": tmp_path / "shm", "collective_timeout_seconds": 5}
        async with Replica(
            tmp_path,
            tiny_model_dir,
            redis_server.url,
            run_id,
            ws_overrides=ws,
            weight_transports=["shm", "collective", "grpc"],
        ) as replica:
            address = f"127.0.0.1:{replica.ws_port}"
            await wait_for(subscribed, 30)
            publishers = {
                kind: make_publisher(kind, address, replica.signer, shm_dir=tmp_path / "shm" / "run")
                for kind in ("grpc", "shm", "collective")
            }
            with torch.no_grad():
                base = replica.engine.model(IDS).logits.clone()
            logits = []
            received = {}
            for version, (kind, model) in enumerate(zip(("grpc", "shm", "collective"), models, strict=True), 1):
                before = received_by(kind)
                await publishers[kind].push(version_of(model, digest), version, version - 1, timeout=60)
                await wait_for(lambda v=version: _version_is(replica.stub, v), 60)
                received[kind] = received_by(kind) - before
                with torch.no_grad():
                    logits.append(replica.engine.model(IDS).logits.clone())
            pulled = BYTES_PULLED._value.get()
            await publishers["grpc"].push(version_of(delta, digest), 4, 3, timeout=60)
            await wait_for(lambda: _version_is(replica.stub, 4), 60)
            delta_bytes = BYTES_PULLED._value.get() - pulled
            with torch.no_grad():
                logits.append(replica.engine.model(IDS).logits.clone())
            refused = []
            for version, bad in enumerate((other_base, other_rank, misfit), 5):
                refusals = refused_by("grpc")
                await publishers["grpc"].push(bad, version, version - 1, timeout=60)
                await wait_for(lambda n=refusals: refused_more("grpc", n), 60)  # the replica read it and refused it
                refused.append((await replica.stub.Status(common_pb2.Empty())).version.version)
            with torch.no_grad():
                after = replica.engine.model(IDS).logits.clone()
            for p in publishers.values():
                await p.close()
        return base, logits, received, delta_bytes, refused, after

    base, logits, received, delta_bytes, refused, after = asyncio.run(asyncio.wait_for(main(), 240))
    with torch.no_grad():
        torch.testing.assert_close(base, load_causal_lm(tiny_model_dir, "float32")(IDS).logits, rtol=0, atol=0)
    for got, want in zip(logits, expected, strict=True):  # base + adapter, as the trainer's model computes it
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert received == {"grpc": 1, "shm": 1, "collective": 1}  # each came by its transport
    adapter_bytes = sum(4 * p.numel() for n, p in delta.named_parameters() if ".lora_" in n)
    assert 0 < delta_bytes < adapter_bytes / 4  # one tensor of the adapter changed: the rest crossed as zeros
    assert refused == [4, 4, 4]  # another base, another rank, tensors that do not fit: the replica serves on
    torch.testing.assert_close(after, logits[-1], rtol=0, atol=0)


@pytest.mark.parametrize("publish, adapter", [("adapter", True), ("merged", False)])
def test_a_lora_trainer_publishes_the_adapter_or_the_merged_model(tmp_path, tiny_model_dir, publish, adapter):
    from services.trainer.config import TrainerSettings
    from services.trainer.model_runner import StepRunner

    settings = TrainerSettings(
        model_path=str(tiny_model_dir),
        out_dir=tmp_path,
        batch_prompts=1,
        group_size=2,
        lora={"rank": 4, "target_modules": ["q_proj"], "publish": publish},
    )
    view = StepRunner(settings).weights()
    names = set(load_causal_lm(tiny_model_dir, "float32").state_dict())
    if adapter:
        assert view.adapter.base_digest == base_digest(str(tiny_model_dir))
        assert sorted(view) == sorted(
            f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{m}.weight" for i in range(2) for m in "AB"
        )
    else:
        assert view.adapter is None and set(view) == names
