"""The trainer role of the patch benchmark (bench/weight_patches.py), timed round by round (bench/clock.py `cycle`):
fp32 master weights, Adam on a batch of the kit's task, each version published by shm whole or as a patch.

Details: docs/internals/bench.md"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import torch

from bench.protocol import end, ready

SIDES = ("whole", "patch")


def patch_trainer(model_dir: str, address: str, shm_dir: str, signing_key: str, lr: str) -> None:
    """fp32 master weights and Adam at `lr` on a batch of the kit's task; each round ("step SIDE
    VERSION") one real optimizer step (untimed), then on `go` the version published in bf16 by shm,
    whole or as a patch. The patch side's copy of the last version is kept current after a whole
    one (untimed), as one publisher's would be."""
    from shared.kit.tiny import TinySpec, char_tokenizer, sft_batch
    from shared.models import load_causal_lm
    from shared.weightsync import make_publisher
    from shared.weightsync.manifest import CastView
    from shared.weightsync.patches import encode_version, patched_bytes
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
            side: make_publisher(
                "shm", address, signer, shm_dir=Path(shm_dir) / side, shm_keep=2, patches=side == "patch"
            )
            for side in SIDES
        }
        print('{"event": "started"}', flush=True)
        while line := await asyncio.to_thread(sys.stdin.readline):
            _, side, version = line.split()
            version = int(version)
            before = bf16()
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            after = bf16()
            changed = sum(int((before[n].view(torch.int16) != after[n].view(torch.int16)).sum()) for n in after)
            total = sum(t.numel() for t in after.values())
            await asyncio.to_thread(ready)
            await publishers[side].push(CastView(params, torch.bfloat16), version, version - 1, timeout=600)
            finished = time.monotonic()
            if side == "whole":  # the patch side's copy follows (untimed): its next patch is against this one
                encoder = publishers["patch"].encoder
                await asyncio.to_thread(encode_version, CastView(params, torch.bfloat16), encoder)
                encoder.version = version
            whole, patch = patched_bytes(publishers[side].last_manifest)  # what it sent of this version
            end(at=finished, kind=side, changed_share=changed / total, whole_bytes=whole, patch_bytes=patch)
        for publisher in publishers.values():
            await publisher.close()

    asyncio.run(main())
