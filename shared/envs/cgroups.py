"""A control group of its own for one sandboxed call (model-written code, an agent program), so its limits hold
for the call as a whole: memory (page cache, tmpfs and memfds included) and processes across everything it starts,
a share of the CPUs where asked for and the cpu controller is there too, and its CPU time read back. cgroup v2 where
this process's cgroup delegates the memory and pids controllers; else cgroup v1's memory and pids hierarchies where
they are writable (root on a hybrid layout); else none (`CallGroup.make` returns None and the caller keeps per-process
limits: docs/security.md says what that changes).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

PREFIX = "steadyrl-sandbox-"
PERIOD_US = 100_000  # the CPU bandwidth period: `cpus` × this much CPU time per period


def _mounts() -> dict[str, Path]:
    """Mount point of each cgroup hierarchy: "unified" for v2, else each v1 controller's name."""
    out: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        before, _, after = line.partition(" - ")
        fields = before.split()
        tail = after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            out.setdefault("unified", Path(fields[4]))
        elif tail[0] == "cgroup":
            for option in tail[2].split(","):
                out.setdefault(option, Path(fields[4]))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup in each hierarchy ("unified" for v2), from /proc/self/cgroup."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else ["unified"]:
                out[name] = path
    return out


def _write(path: Path, value: str) -> None:
    path.write_text(value)


class CallGroup:
    """The cgroup directories of one call (one for v2, one per controller for v1)."""

    def __init__(self, dirs: dict[str, Path], version: int) -> None:
        self.dirs = dirs
        self.version = version
        self.cpu_limited = False  # whether a CPU share was asked for and holds

    @property
    def procs(self) -> list[str]:
        """The cgroup.procs files a process writes "0" into to join the call's cgroup(s)."""
        return [str(d / "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    @classmethod
    def make(cls, memory_bytes: int, max_processes: int, cpus: float | None = None) -> CallGroup | None:
        """A fresh cgroup limited to `memory_bytes` and `max_processes` (and `cpus` CPUs' worth of time where
        the cpu controller can be had: `cpu_limited` says), or None where none can be made."""
        mounts = _mounts()
        own = _own_paths()
        name = PREFIX + uuid.uuid4().hex[:12]
        if "unified" in mounts and "unified" in own:
            base = mounts["unified"] / own["unified"].lstrip("/")
            made = cls._make_v2(base, name, memory_bytes, max_processes, cpus)
            if made is not None:
                return made
        if {"memory", "pids"} <= mounts.keys() and {"memory", "pids"} <= own.keys():
            return cls._make_v1(mounts, own, name, memory_bytes, max_processes, cpus)
        return None

    @classmethod
    def _make_v2(
        cls, base: Path, name: str, memory_bytes: int, max_processes: int, cpus: float | None
    ) -> CallGroup | None:
        try:
            controllers = set((base / "cgroup.subtree_control").read_text().split())
            if not {"memory", "pids"} <= controllers:
                return None
            path = base / name
            path.mkdir()
        except OSError:
            return None
        group = cls({"unified": path}, 2)
        try:
            _write(path / "memory.max", str(memory_bytes))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to bound
                _write(path / "memory.swap.max", "0")
            _write(path / "pids.max", str(max_processes))
            if cpus is not None and "cpu" in controllers:
                _write(path / "cpu.max", f"{_quota(cpus)} {PERIOD_US}")
                group.cpu_limited = True
        except OSError:
            group.close()
            return None
        return group

    @classmethod
    def _make_v1(
        cls,
        mounts: dict[str, Path],
        own: dict[str, str],
        name: str,
        memory_bytes: int,
        max_processes: int,
        cpus: float | None,
    ) -> CallGroup | None:
        optional = ["cpuacct"] + (["cpu"] if cpus is not None else [])
        wanted = ["memory", "pids"] + [c for c in optional if c in mounts and c in own]
        group = cls({}, 1)
        try:
            for controller in wanted:
                path = mounts[controller] / own[controller].lstrip("/") / name
                if path not in group.dirs.values():  # cpu and cpuacct are often one hierarchy
                    path.mkdir()
                group.dirs[controller] = path
            _write(group.dirs["memory"] / "memory.limit_in_bytes", str(memory_bytes))
            with contextlib.suppress(OSError):  # swap accounting off: nothing to bound
                _write(group.dirs["memory"] / "memory.memsw.limit_in_bytes", str(memory_bytes))
            _write(group.dirs["pids"] / "pids.max", str(max_processes))
        except OSError:
            group.close()
            return None
        if "cpu" in group.dirs:
            try:
                _write(group.dirs["cpu"] / "cpu.cfs_period_us", str(PERIOD_US))
                _write(group.dirs["cpu"] / "cpu.cfs_quota_us", str(_quota(cpus)))
                group.cpu_limited = True
            except OSError:  # no CPU bandwidth control here: the caller's rlimit holds instead
                pass
        return group

    def cpu_seconds(self) -> float | None:
        """CPU time of everything the call ran (None where the cgroup does not count it)."""
        try:
            if self.version == 2:
                stat = dict(line.split() for line in (self.dirs["unified"] / "cpu.stat").read_text().splitlines())
                return int(stat["usage_usec"]) / 1e6
            if "cpuacct" in self.dirs:
                return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        except (OSError, KeyError, ValueError):
            return None
        return None

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the call for its memory limit."""
        try:
            if self.version == 2:
                events = (self.dirs["unified"] / "memory.events").read_text()
            else:
                events = (self.dirs["memory"] / "memory.oom_control").read_text()
        except (OSError, KeyError):
            return False
        counts = dict(line.split() for line in events.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0)) > 0

    def pids(self) -> list[int]:
        found: set[int] = set()
        for procs in self.procs:
            with contextlib.suppress(OSError, ValueError):
                found.update(int(p) for p in Path(procs).read_text().split())
        return sorted(found)

    def close(self, seconds: float = 5.0) -> None:
        """Kill whatever of the call still runs (bounded wait) and remove its cgroup(s)."""
        deadline = time.monotonic() + seconds
        while self.dirs and time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        for path in set(self.dirs.values()):
            with contextlib.suppress(OSError):
                path.rmdir()
        self.dirs = {}


def _quota(cpus: float) -> int:
    return max(1000, round(cpus * PERIOD_US))  # the kernel's least quota is 1 ms
