"""The calling thread's name given to the OS (Linux: PR_SET_NAME, first 15 bytes), so `top -H`,
py-spy and /proc/<pid>/task/<tid>/comm tell a service's threads apart: its engine, its update,
its scoring and its asyncio executor threads (`bench/thread_cpu.py` sums CPU per name)."""

from __future__ import annotations

import functools
import sys
import threading

PR_SET_NAME = 15


@functools.cache
def libc_prctl():
    """libc's prctl, looked up once (find_library runs a subprocess)."""
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl


def name_os_thread(name: str | None = None) -> None:
    """Give the OS the calling thread's name (`name`, else its `threading` name); elsewhere than
    Linux, nothing."""
    if sys.platform == "linux":
        text = (name or threading.current_thread().name).encode(errors="replace")[:15]
        libc_prctl()(PR_SET_NAME, text, 0, 0, 0)
