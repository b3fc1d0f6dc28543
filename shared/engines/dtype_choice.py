"""`inference.dtype = "auto"`: the precision a replica serves fastest on this machine.

On a GPU that is bfloat16. On a CPU it depends on the chip and the model's width (a CPU with
bf16 instructions can still run small bf16 matmuls slower than fp32), so it is measured: the
model's MLP-shaped matmul in float32 and in bfloat16, rounds interleaved, the faster kept. The
measurement takes about 0.1 s and is done once per process.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

AUTO = "auto"


def model_width(model_path: str | None) -> int:
    """The model's hidden size from its config.json (1,024 when it cannot be read)."""
    try:
        return int(json.loads((Path(model_path or "") / "config.json").read_text())["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1024


@functools.cache
def matmul_seconds(width: int, threads: int = 1, rows: int = 256, rounds: int = 7) -> dict[str, float]:
    """The fastest of `rounds` [rows, width] × [width, 4·width] matmuls per dtype, interleaved."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a32, b32 = torch.randn(rows, width), torch.randn(width, 4 * width)
        pairs = {"float32": (a32, b32), "bfloat16": (a32.bfloat16(), b32.bfloat16())}
        best = dict.fromkeys(pairs, float("inf"))
        for _ in range(rounds):
            for name, (a, b) in pairs.items():
                started = time.perf_counter()
                for _ in range(4):
                    a @ b
                best[name] = min(best[name], (time.perf_counter() - started) / 4)
        return best
    finally:
        torch.set_num_threads(previous)


def choose_dtype(gpus: int, model_path: str | None = None, threads: int = 0) -> tuple[str, str]:
    """(dtype, why) for a replica with `gpus` GPUs (0: the CPU) serving `model_path`."""
    if gpus > 0:
        return "bfloat16", "a GPU replica serves bfloat16"
    width = model_width(model_path)
    seconds = matmul_seconds(width, max(threads, 1))
    chosen = min(seconds, key=seconds.__getitem__)
    timings = ", ".join(f"{name} {s * 1e3:.3f} ms" for name, s in seconds.items())
    return chosen, f"the faster on this CPU at width {width} ({timings} per matmul)"
