"""The trainer role of the patch benchmark (bench/weight_patches.py), timed round by round (bench/clock.py `cycle`):
fp32 master weights, Adam on a batch of the kit's task, each version published by shm or collective, whole or as a
patch.

Details: docs/internals/bench.md"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import torch

from bench.protocol import end, ready

SIDES = ("whole", "patch")
TRANSPORTS = ("shm", "collective")
COMBOS = tuple((transport, side) for transport in TRANSPORTS for side in SIDES)  # a round's order, or reversed


def sent_bytes() -> tuple[float, float]:
    """(whole, patch) bytes every publisher of this process has sent so far (`steadyrl_weights_bytes_total`):
    a version's are the difference over its push, on every transport alike."""
    from prometheus_client import REGISTRY

    def of(kind: str) -> float:
        return REGISTRY.get_sample_value("steadyrl_weights_bytes_total", {"kind": kind}) or 0.0

    return of("full"), of("patch")


def patch_trainer(model_dir: str, address: str, shm_dir: str, signing_key: str, lr: str) -> None:
    """fp32 master weights and Adam at `lr` on a batch of the kit's task; each round ("step TRANSPORT
    SIDE VERSION") one real optimizer step (untimed), then on `go` the version published in bf16 by
    that transport's whole or patching publisher. Every patching publisher's copy is brought up to
    the last version before the step (untimed, while no replica works), as one publisher's would be:
    each patch is against the version before it, which the replica serves."""
    from shared.kit.tiny import TinySpec, char_tokenizer, sft_batch
    from shared.models import load_causal_lm
    from shared.weightsync import make_publisher
    from shared.weightsync.manifest import CastView
    from shared.weightsync.patches import encode_version
    from shared.weightsync.signing import Signer

    model = load_causal_lm(model_dir, "float32").train()
    ids, labels = sft_batch(char_tokenizer(), TinySpec().task().split("train", 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=float(lr))
    params = model.state_dict()

    def bf16() -> dict[str, torch.Tensor]:
        return {name: t.detach().to(torch.bfloat16) for name, t in params.items()}

    async def main() -> None:
        signer = Signer.from_file(Path(signing_key))
        publishers = {
            (transport, side): make_publisher(
                transport, address, signer, shm_dir=Path(shm_dir) / side, shm_keep=2, patches=side == "patch"
            )
            for transport, side in COMBOS
        }
        # one trainer's group: two publishers leading groups of their own would re-form it at every switch
        publishers["collective", "patch"].groups = publishers["collective", "whole"].groups
        encoders = [publishers[transport, "patch"].encoder for transport in TRANSPORTS]
        print('{"event": "started"}', flush=True)
        while line := await asyncio.to_thread(sys.stdin.readline):
            _, transport, side, version = line.split()
            version = int(version)
            for encoder in encoders:  # the params are still the last version's: each copy brought up to it
                if version > 1 and encoder.version != version - 1:
                    await asyncio.to_thread(encode_version, CastView(params, torch.bfloat16), encoder)
                    encoder.version = version - 1
            before = bf16()
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            after = bf16()
            changed = sum(int((before[n].view(torch.int16) != after[n].view(torch.int16)).sum()) for n in after)
            total = sum(t.numel() for t in after.values())
            publisher = publishers[transport, side]
            base = publisher.encoder.version if side == "patch" else 0  # what its patches apply to
            counted = sent_bytes()
            await asyncio.to_thread(ready)
            await publisher.push(CastView(params, torch.bfloat16), version, version - 1, timeout=600)
            finished = time.monotonic()
            whole, patch = (round(b - a) for a, b in zip(counted, sent_bytes(), strict=True))
            end(
                at=finished,
                kind=f"{transport} {side}",
                changed_share=changed / total,
                whole_bytes=whole,
                patch_bytes=patch,
                patch_base=base if patch else 0,
            )
        for publisher in publishers.values():
            await publisher.close()

    asyncio.run(main())
