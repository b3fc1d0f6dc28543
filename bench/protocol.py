"""A benchmark process's side of the clock (bench/clock.py): say `ready` once set up, wait for
`go`, and say `end` the moment its part is done."""

from __future__ import annotations

import json
import sys
import time


def ready(**extra: object) -> None:
    """Say ready, then wait for `go` (the clock starts in the parent, bench/clock.py, before it is sent)."""
    print(json.dumps({"event": "ready", **extra}), flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go: the benchmark was stopped")


def end(**extra: object) -> None:
    """The moment this process's part is done, on the clock every process of a host shares."""
    print(json.dumps({"event": "end", "at": time.monotonic(), **extra}), flush=True)
