"""A replica on the vllm engine (in its own process: vLLM spawns workers and needs a __main__
guard) with the weight-sync service beside it; versions 1, 2, 3 arrive by gRPC, shared memory
and a gloo broadcast in turn, and after each it prints what the engine then generates greedily,
with logprobs. Used by test_vllm_engine."""

import asyncio
import json
import sys
from pathlib import Path

TRANSPORTS = ("grpc", "shm", "collective")
PATCH_VERSIONS = 47  # versions 4 to 50 by shm with patches on


async def run(model_dir: str, redis_url: str, run_id: str, tmp: Path, prompts: list[list[int]]) -> dict:
    from shared.engines import Sampling, make_engine
    from shared.weightsync import make_publisher
    from tests.integration.test_inference import Replica, _version_is, wait_for
    from tests.integration.test_weight_transports import received_by, subscribed, versions

    engine = make_engine("vllm", model_dir, "float32", max_model_len=64)
    ws = {"shm_dir": tmp / "shm", "collective_timeout_seconds": 30}
    out: dict = {}
    async with Replica(
        tmp,
        model_dir,
        redis_url,
        run_id,
        ws_overrides=ws,
        engine=engine,
        weight_transports=["shm", "collective", "grpc"],
    ) as replica:
        await wait_for(subscribed, 60)
        address = f"127.0.0.1:{replica.ws_port}"
        for version, (kind, tensors) in enumerate(zip(TRANSPORTS, versions(model_dir, 3), strict=True), 1):
            before = received_by(kind)
            publisher = make_publisher(kind, address, replica.signer, shm_dir=tmp / "shm" / "run")
            await publisher.push(tensors, version, version - 1, timeout=120)
            await wait_for(lambda v=version: _version_is(replica.stub, v), 120)
            await publisher.close()
            greedy = await asyncio.to_thread(engine.generate, prompts, Sampling(temperature=0, max_new_tokens=10))
            out[kind] = {
                "version": version,
                "received": received_by(kind) - before,
                "samples": [vars(s) for s in greedy],
            }
        # patches by shm: version 4 whole, 5 (the workers keep no bytes yet) whole by a gRPC pull, 6 to 50
        # patches; the bytes the workers keep are read back every tenth version
        publisher = make_publisher("shm", address, replica.signer, shm_dir=tmp / "shm" / "run", patches=True)
        before = {kind: received_by(kind) for kind in ("shm", "grpc")}
        kept_at = {}
        for version, tensors in enumerate(patch_versions(model_dir, PATCH_VERSIONS), 4):
            await publisher.push(tensors, version, version - 1, timeout=120)
            await wait_for(lambda v=version: _version_is(replica.stub, v), 120)
            if version % 10 == 0:
                kept_at[version] = await asyncio.to_thread(kept_digests, engine)
        await publisher.close()
        greedy = await asyncio.to_thread(engine.generate, prompts, Sampling(temperature=0, max_new_tokens=10))
        out["patches"] = {
            "version": 3 + PATCH_VERSIONS,
            "received": {kind: received_by(kind) - was for kind, was in before.items()},
            "kept": engine.last_update.get("kept"),
            "kept_digests": await asyncio.to_thread(kept_digests, engine),
            "kept_at": kept_at,
            "samples": [vars(s) for s in greedy],
        }
    engine.close()
    return out


def kept_digests(engine) -> dict[str, str]:
    """The first worker's digest of each tensor's kept published bytes."""
    return engine._call(engine.llm.collective_rpc("steadyrl_kept_digests"))[0]


def patch_versions(model_dir: str, count: int) -> list[dict]:
    """`count` bf16 versions a small step apart (most elements unchanged: each goes as a patch)."""
    import torch

    from shared.models import load_causal_lm
    from shared.weightsync.manifest import CastView

    master = load_causal_lm(model_dir, "float32").state_dict()
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        for tensor in master.values():
            tensor.add_(2e-5 * torch.randn(tensor.shape, generator=generator).sign())
        out.append({name: t.clone() for name, t in CastView(master, torch.bfloat16).items()})
    return out


def main() -> None:
    model_dir, redis_url, run_id, tmp, prompts = sys.argv[1:6]
    out = asyncio.run(asyncio.wait_for(run(model_dir, redis_url, run_id, Path(tmp), json.loads(prompts)), 600))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
