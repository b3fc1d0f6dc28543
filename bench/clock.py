"""One clock for every side of a benchmark run.

Each side is a set of processes (`python -m bench.roles ROLE ...`). They are started and made
ready first — interpreter, imports, connections, resident buffers, a warm-up where the real
thing has one — and each says `ready`. The clock then starts (CLOCK_MONOTONIC, one clock for every
process of a host) and a `go` line releases them, stage by stage: a later stage (a replica mapping
what the trainer wrote) is released when every process of the stage before has finished. The
clock stops at the last process's own `end` reading. So a transport, the raw socket it is compared
with and a memcpy of the same bytes are all timed from the same release to the same arrival,
never including an interpreter's start or exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spawn(role: str, *args: object) -> subprocess.Popen:
    """A process of `role` (bench/roles.py), one torch thread, waiting for `go` once ready."""
    return subprocess.Popen([sys.executable, "-m", "bench.roles", role, *map(str, args)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def expect(process: subprocess.Popen, want: str) -> dict:
    line = process.stdout.readline()
    if not line:
        process.wait(30)
        raise RuntimeError(f"bench role {process.args[3]} exited with {process.returncode} before {want!r}")
    reply = json.loads(line)
    if reply.get("event") != want:
        raise RuntimeError(f"bench role {process.args[3]}: expected {want!r}, got {reply}")
    return reply


def timed(stages: list[list[subprocess.Popen]], timeout: float = 600.0) -> dict:
    """Seconds from the release of the first stage to the last `end` of the last, and what each
    process reported at its end (by stage). Every process is waited for, and killed on an error."""
    processes = [p for stage in stages for p in stage]
    try:
        for process in processes:
            expect(process, "ready")
        started = time.monotonic()
        reports = []
        for stage in stages:
            for process in stage:
                process.stdin.write("go\n")
                process.stdin.flush()
            reports.append([expect(process, "end") for process in stage])
        for process in processes:
            process.stdin.close()
            process.wait(timeout)
        ends = [max(r["at"] for r in stage) for stage in reports]
        return {"seconds": ends[-1] - started, "stage_seconds": [b - a for a, b in zip([started, *ends], ends, strict=False)],
                "reports": reports}
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
