"""One clock for every side of a benchmark run.

Each side is a set of processes (`python -m bench.roles ROLE ...`), made ready first, each saying `ready`; the clock
(CLOCK_MONOTONIC) starts, a `go` line releases them stage by stage, and it stops at the last process's own `end`
reading, never counting an interpreter's start or exit. Long-running roles are timed round by round (`cycle`). Every
read of a role's output is bounded (`expect`'s timeout): a role that hangs fails the run.

Details: docs/internals/bench.md"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600.0


def spawn(role: str, *args: object, env: dict | None = None) -> subprocess.Popen:
    """A process of `role` (bench/roles.py), one torch thread, waiting for `go` once ready. Its
    stdout lines are read by a thread of their own into `process.lines` (so a wait is bounded)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.roles", role, *map(str, args)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    process.lines = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            if line.startswith("{"):
                process.lines.put(line)
        process.lines.put("")  # the process closed its output

    threading.Thread(target=read, daemon=True, name=f"bench-{role}").start()
    return process


def expect(process: subprocess.Popen, want: str, timeout: float = TIMEOUT) -> dict:
    try:
        line = process.lines.get(timeout=timeout)
    except queue.Empty:
        raise RuntimeError(f"bench role {process.args[3]}: no {want!r} within {timeout:.0f} s") from None
    if not line:
        process.wait(30)
        raise RuntimeError(f"bench role {process.args[3]} exited with {process.returncode} before {want!r}")
    reply = json.loads(line)
    if reply.get("event") != want:
        raise RuntimeError(f"bench role {process.args[3]}: expected {want!r}, got {reply}")
    return reply


def send(processes: list[subprocess.Popen], line: str) -> None:
    for process in processes:
        process.stdin.write(line + "\n")
        process.stdin.flush()


def cycle(processes: list[subprocess.Popen], line: str = "go", timeout: float = TIMEOUT) -> dict:
    """One timed round of long-running processes: each says ready, the clock starts, `line`
    releases them all at once, the clock stops at the last `end`; they stay up."""
    for process in processes:
        expect(process, "ready", timeout)
    started = time.monotonic()
    send(processes, line)
    reports = [expect(process, "end", timeout) for process in processes]
    return {"seconds": max(r["at"] for r in reports) - started, "started": started, "reports": reports}


def stop(processes: list[subprocess.Popen], timeout: float = 60.0) -> None:
    """Close every process's input (a role ends on it), wait, kill what does not end."""
    for process in processes:
        if process.poll() is None and not process.stdin.closed:
            process.stdin.close()
    for process in processes:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def timed(stages: list[list[subprocess.Popen]], timeout: float = TIMEOUT) -> dict:
    """Seconds from the release of the first stage to the last `end` of the last, and what each
    process reported at its end (by stage). Every process is waited for, and killed on an error."""
    processes = [p for stage in stages for p in stage]
    try:
        for process in processes:
            expect(process, "ready", timeout)
        started = time.monotonic()
        reports = []
        for stage in stages:
            send(stage, "go")
            reports.append([expect(process, "end", timeout) for process in stage])
        stop(processes, timeout)
        ends = [max(r["at"] for r in stage) for stage in reports]
        return {
            "seconds": ends[-1] - started,
            "stage_seconds": [b - a for a, b in zip([started, *ends], ends, strict=False)],
            "reports": reports,
        }
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
