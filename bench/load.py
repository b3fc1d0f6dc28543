"""The machine's load around a benchmark's run (the load average before it, the share of every core
busy while it ran), recorded beside each timing so a figure measured on a busy machine says so."""

from __future__ import annotations

import os
from pathlib import Path


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot, from /proc/stat ((0, 0) elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class Load:
    """The machine's load around one run: the 1-minute load average before it, and the share of
    every core busy (anyone's work, the run's included) while it ran."""

    def __enter__(self) -> Load:
        self.load_before = round(os.getloadavg()[0], 2)
        self.ticks = machine_ticks()
        return self

    def __exit__(self, *exc) -> None:
        busy, total = machine_ticks()
        spent = total - self.ticks[1]
        self.busy_share = round((busy - self.ticks[0]) / spent, 3) if spent else None

    def record(self) -> dict:
        return {"load_1min_before": self.load_before, "machine_busy_share": self.busy_share}
