"""torch's intra-op thread count, applied where the work runs.

`torch.set_num_threads` sets the OpenMP and MKL thread counts of the calling thread only: set in
one thread, it does not reach a worker thread that runs the model later (measured here: a
matmul on an executor thread still used both cores after `set_num_threads(1)` in another thread).
Services load models in one thread and run them in others, so the count is bound per thread.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def bind_torch_threads(threads: int) -> None:
    """Give the calling thread `threads` intra-op threads (0: leave torch's default), once per thread."""
    if threads and getattr(_local, "threads", None) != threads:
        torch.set_num_threads(threads)
        _local.threads = threads
