"""Patch versions against whole ones, side by side on one clock (bench/clock.py): a trainer takes real Adam steps and
publishes each version by shm or by collective (gloo), whole or as a patch, the four alternated round by round; a
replica (the torch engine in bf16) serves each version's first token. Measured: the share of bf16 elements each step
changes, bytes per version patch / whole, refit seconds patch / whole on each transport, the replica's pause; on a
~100M-parameter Qwen3-MoE at lr 1e-6 and on the demo's model at its lr 1e-3 (where the publisher must fall back to
whole versions at no measurable cost). Prints one JSON object.

Details: docs/internals/bench.md"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.clock import cycle, expect, send, spawn, stop
from bench.patch_roles import COMBOS, SIDES, TRANSPORTS
from bench.weightsync import WeightSync

TARGETS = {"patch_over_whole_bytes": 0.05, "patch_over_whole_refit": 0.2, "demo_whole_over_patch_refit": 0.98}
WARMUP = len(COMBOS)  # untimed versions, one round: each (transport, side)'s first use, the collective's group


def rounds_of(model_dir: Path, lr: float, rounds: int, tmp: Path) -> list[dict]:
    """An untimed round of `WARMUP` versions, then `rounds` timed versions per transport (half whole, half
    patch): each round one version per (transport, side), in `COMBOS` order or reversed, alternately. One
    record per timed version: its transport, side, refit seconds, the replica's pause and transport (a
    patch version it took whole comes by grpc), what was sent and the version its patches apply to."""
    from shared.weightsync.signing import write_key_pair

    shm_dir = tmp / "shm"
    private, public = write_key_pair(tmp / "keys")
    service = WeightSync(shm_dir, tmp / "spill", public)
    processes = []
    try:
        trainer = spawn("patch_trainer", model_dir, service.address, shm_dir / "run", private, lr)
        replica = spawn("replica", "torch", model_dir, service.address, "torch-0", public)
        processes = [trainer, replica]
        for process in processes:
            expect(process, "started")
        out = []
        version = 0
        for round_ in range(1 + (rounds + 1) // 2):
            for transport, side in COMBOS if round_ % 2 == 0 else tuple(reversed(COMBOS)):
                version += 1
                send([trainer], f"step {transport} {side} {version}")
                send([replica], f"await {version}")
                result = cycle(processes)
                if version > WARMUP:
                    published, served = result["reports"]
                    out.append(
                        {
                            "transport": transport,
                            "side": side,
                            "version": version,
                            "seconds": result["seconds"],
                            "paused_seconds": served["paused_seconds"],
                            "served_by": served["transport"],
                            **{k: published[k] for k in ("changed_share", "whole_bytes", "patch_bytes", "patch_base")},
                        }
                    )
        return out
    finally:
        stop(processes)
        service.close()
        shutil.rmtree(shm_dir, ignore_errors=True)


def one_transport(records: list[dict], model_bytes: int) -> dict:
    """One transport's versions: medians per side, patch / whole ratios of bytes and refit seconds, and
    their spread over the interleaved pairs (each patch version beside the whole one next to it)."""
    by = {side: [r for r in records if r["side"] == side] for side in SIDES}
    pairs = list(zip(by["whole"], by["patch"], strict=False))
    median = {side: statistics.median(r["seconds"] for r in rs) for side, rs in by.items()}
    ratios = sorted(round(p["seconds"] / w["seconds"], 3) for w, p in pairs)
    patch_bytes = [r["whole_bytes"] + r["patch_bytes"] for r in by["patch"]]
    return {
        "versions": len(records),
        "pairs": len(pairs),
        "changed_share": [
            round(min(r["changed_share"] for r in records), 4),
            round(max(r["changed_share"] for r in records), 4),
        ],
        "bytes_patch_over_whole": round(statistics.median(patch_bytes) / model_bytes, 4),
        "bytes_patch_over_whole_range": [
            round(min(patch_bytes) / model_bytes, 4),
            round(max(patch_bytes) / model_bytes, 4),
        ],
        "tensors_whole_bytes": statistics.median(r["whole_bytes"] for r in by["patch"]),
        "refit_seconds": {side: round(s, 4) for side, s in median.items()},
        "refit_patch_over_whole": round(median["patch"] / median["whole"], 3),
        "refit_whole_over_patch": round(median["whole"] / median["patch"], 3),
        "refit_patch_over_whole_spread": [ratios[0], ratios[-1]],
        "paused_seconds": {
            side: round(statistics.median(r["paused_seconds"] for r in rs), 4) for side, rs in by.items()
        },
        "transports": sorted({r["served_by"] for r in records}),
        # patch versions the replica did not take as patches (by grpc, whole): they measure no patch
        "patch_taken_whole": sum(r["served_by"] != r["transport"] for r in by["patch"]),
    }


def summarise(records: list[dict], model_bytes: int) -> dict:
    """shm's figures at the top (the keys they always had), every transport's under `by_transport`."""
    by_transport = {t: one_transport([r for r in records if r["transport"] == t], model_bytes) for t in TRANSPORTS}
    top = {k: v for k, v in by_transport["shm"].items() if k not in ("refit_whole_over_patch", "patch_taken_whole")}
    return {"model_bytes": model_bytes, **top, "by_transport": by_transport}


def formats(model_dir: Path, lr: float) -> dict:
    """Bytes of one real Adam step's change in each candidate form, as shares of the bf16 version: int32
    indices + raw values; zstd of uint32 gaps + raw values; zstd of the whole tensor XOR the last; and the
    form patches use (zstd of byte gaps, zstd of the changed elements' XOR)."""
    import numpy as np
    import zstandard

    from shared.kit.tiny import TinySpec, char_tokenizer, sft_batch
    from shared.models import load_causal_lm
    from shared.weightsync.patches import encode

    model = load_causal_lm(model_dir, "float32").train()
    ids, labels = sft_batch(char_tokenizer(), TinySpec().task().split("train", 8))
    before = {
        n: t.detach().to(torch.bfloat16).view(torch.int16).reshape(-1).numpy().copy()
        for n, t in model.state_dict().items()
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model(input_ids=ids, labels=labels).loss.backward()
    optimizer.step()
    compress = zstandard.ZstdCompressor(level=1).compress
    sizes = dict.fromkeys(("indices_values", "uint32_gaps_zstd", "whole_xor_zstd", "patch"), 0)
    total = changed = 0
    for name, tensor in model.state_dict().items():
        new = tensor.detach().to(torch.bfloat16).view(torch.int16).reshape(-1).numpy()
        old = before[name]
        at = np.flatnonzero(new != old)
        total, changed = total + 2 * new.size, changed + at.size
        sizes["indices_values"] += 6 * at.size
        sizes["uint32_gaps_zstd"] += len(compress(np.diff(at, prepend=0).astype(np.uint32).tobytes())) + 2 * at.size
        sizes["whole_xor_zstd"] += len(compress((new ^ old).tobytes()))
        sizes["patch"] += len(encode(at, new[at] ^ old[at])[0])
    return {"changed_share": round(changed / (total / 2), 4), **{k: round(v / total, 4) for k, v in sizes.items()}}


def main(rounds: int = 18, demo_rounds: int = 18) -> dict:
    from bench.load import Load
    from bench.trainer_memory import wide_model
    from shared.kit.tiny import init_tiny_model
    from shared.models import load_causal_lm

    started = time.monotonic()
    out: dict = {"benchmark": "weight_patches", "targets": TARGETS, "warmup_rounds": WARMUP}
    with (
        tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as shm_tmp,
        tempfile.TemporaryDirectory() as disk_tmp,
    ):
        model_dir = Path(disk_tmp) / "wide"
        model = wide_model(num_hidden_layers=2)
        model.save_pretrained(model_dir)
        params = sum(t.numel() for t in model.state_dict().values())
        del model
        with Load() as load:
            records = rounds_of(model_dir, 1e-6, rounds, Path(shm_tmp) / "wide")
        out["qwen3_100m"] = {"params": params, "lr": 1e-6, **summarise(records, 2 * params), **load.record()}
        out["qwen3_100m"]["formats"] = formats(model_dir, 1e-6)
        demo = init_tiny_model()
        demo_params = sum(t.numel() for t in load_causal_lm(demo, "float32").state_dict().values())
        with Load() as load:
            records = rounds_of(demo, 1e-3, demo_rounds, Path(shm_tmp) / "demo")
        summary = summarise(records, 2 * demo_params)
        summary["refit_whole_over_patch"] = summary["by_transport"]["shm"]["refit_whole_over_patch"]
        out["demo"] = {"params": demo_params, "lr": 1e-3, **summary, **load.record()}
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:]))))
