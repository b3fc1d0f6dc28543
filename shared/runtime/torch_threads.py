"""torch's intra-op thread count, applied where the work runs.

`torch.set_num_threads` sets the OpenMP and MKL thread counts of the calling thread only: set in
one thread, it does not reach a worker thread that runs the model later (measured here: a
matmul on an executor thread still used both cores after `set_num_threads(1)` in another thread).
Services load models in one thread and run them in others, so the count is bound per thread.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from shared.runtime.thread_names import name_os_thread

_local = threading.local()
_bound: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop → the count its executor binds


def bind_torch_threads(threads: int) -> None:
    """Give the calling thread `threads` intra-op threads (0: leave torch's default), once per
    thread; an executor's thread also gets its name at the OS (`name_os_thread`)."""
    if getattr(_local, "named", False) is False:
        name_os_thread()
        _local.named = True
    if threads and getattr(_local, "threads", None) != threads:
        torch.set_num_threads(threads)
        _local.threads = threads


def bind_default_executor(threads: int) -> None:
    """Make the running loop's default executor (`asyncio.to_thread`) bind each of its threads to
    `threads` intra-op threads (0: leave it). An unbound thread runs a large op (a version copied
    in, a cast to publish) as an OpenMP region over every core: on a busy machine it waits for a
    second thread the scheduler has not run yet (the replica paused ~5 ms a version for a 0.1 ms copy)."""
    loop = asyncio.get_running_loop()
    if threads and _bound.get(loop) != threads:  # services sharing a loop (in one test) set it once
        executor = ThreadPoolExecutor(thread_name_prefix="asyncio", initializer=bind_torch_threads, initargs=(threads,))
        loop.set_default_executor(executor)
        _bound[loop] = threads
