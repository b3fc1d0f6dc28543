"""Per-thread CPU of a running `steadyrl run`, read from /proc: which thread of which service
spends the two cores, per training step. `snapshot(root_pid)` reads every thread of the run's
process tree (its utime + stime and its OS name, `shared.runtime.thread_names`); two snapshots,
divided by the steps between them, give CPU milliseconds per step by service and thread. The
control threads do no model math: a replica's and the trainer's asyncio main thread, the
orchestrator and Redis (docs/internals/bench.md#benchthread_cpupy). Linux only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SERVICES = ("trainer", "inference", "orchestrator", "weightsync")
# (service, thread) pairs that do no model math; "*" is every thread of that service
CONTROL = (("inference", "main"), ("trainer", "main"), ("orchestrator", "*"), ("redis", "*"))


def _stat(path: Path) -> tuple[int, str, int] | None:
    """(ppid, comm, utime + stime ticks) of /proc/<pid>[/task/<tid>]/stat, None if it is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), comm, int(fields[11]) + int(fields[12])


def service_of(pid: int) -> str | None:
    """The steadyrl service (or redis) a process runs, from its command line; None for others."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [a.decode(errors="replace") for a in argv]
    if words and "redis-server" in words[0]:
        return "redis"
    for word in words:
        for service in SERVICES:
            if word == f"services.{service}":
                return service
    return None


def descendants(root: int) -> list[int]:
    """Every live process under `root` (itself included)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(entry / "stat")) is not None:
            parents.setdefault(stat[0], []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, []))
    return found


def snapshot(root: int) -> dict[tuple[str, int], tuple[str, int]]:
    """{(service, tid): (thread name, CPU ticks)} for every thread of the run's services; a
    process's first thread is named "main", the others by their OS name."""
    threads = {}
    for pid in descendants(root):
        service = service_of(pid)
        if service is None:
            continue
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            if (stat := _stat(Path(f"/proc/{pid}/task/{tid}/stat"))) is not None:
                threads[(service, tid)] = ("main" if tid == pid else stat[1], stat[2])
    return threads


def per_step(before: dict, after: dict, steps: int) -> dict[str, dict[str, float]]:
    """CPU milliseconds per step by service and thread name (threads of one name summed), from two
    snapshots `steps` steps apart; a thread born in between counts from zero. Pure."""
    out: dict[str, dict[str, float]] = {}
    for (service, tid), (name, ticks) in after.items():
        spent = ticks - before.get((service, tid), (name, 0))[1]
        if spent > 0:
            threads = out.setdefault(service, {})
            threads[name] = threads.get(name, 0.0) + spent * 1000 / TICK / steps
    return {s: {n: round(v, 2) for n, v in sorted(t.items())} for s, t in sorted(out.items())}


def control_ms(threads: dict[str, dict[str, float]]) -> dict[str, float]:
    """The control threads' CPU ms per step (CONTROL), each and in total. Pure."""
    parts = {}
    for service, name in CONTROL:
        mine = threads.get(service, {})
        parts[f"{service}.{name}"] = round(sum(mine.values()) if name == "*" else mine.get(name, 0.0), 2)
    parts["total"] = round(sum(parts.values()), 2)
    return parts


def demo_threads(recipe: str, settings: list[str], first: int, last: int, out: Path) -> dict:
    """`steadyrl run RECIPE` (the console script beside this interpreter) with `settings`, every
    thread's CPU per step between the end of step `first` and of step `last` (metrics.jsonl polled
    every 50 ms), and the wall seconds of that window; the run goes on to its end."""
    command = [str(Path(sys.executable).with_name("steadyrl")), "run", recipe, "--out", str(out), "--progress", "none"]
    process = subprocess.Popen(
        [*command, *(a for s in settings for a in ("--set", s))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    marks: dict[int, tuple[float, dict, int]] = {}
    metrics = out / "trainer" / "metrics.jsonl"
    while process.poll() is None and len(marks) < 2:
        at = last_step(metrics)
        for mark in (first, last):
            if mark not in marks and at >= mark:
                marks[mark] = (time.perf_counter(), snapshot(process.pid), at)
        time.sleep(0.05)
    _, stderr = process.communicate(timeout=1800)
    if process.returncode != 0 or len(marks) < 2:
        raise RuntimeError(f"the run failed ({process.returncode}): {stderr[-2000:]}")
    (t0, before, s0), (t1, after, s1) = marks[first], marks[last]
    threads = per_step(before, after, s1 - s0)
    return {
        "steps": s1 - s0,
        "seconds_per_step": round((t1 - t0) / (s1 - s0), 4),
        "cpu_ms_per_step": threads,
        "control_ms_per_step": control_ms(threads),
    }


def last_step(metrics: Path) -> int:
    """The last step line's step in a metrics.jsonl being written (0: none yet); a line still
    being written is not read."""
    try:
        lines = metrics.read_text().split("\n")[:-1]
    except OSError:
        return 0
    for line in reversed(lines):
        if '"step_seconds"' in line:
            return int(json.loads(line)["step"])
    return 0
