"""What a kit model's first-use build shows while it runs (the tiny model, the judge, the teacher, the
calc model: up to a few minutes on a CPU): what it is doing and how far it is, one log line at each of
its measurements and at most every `every_seconds` between them, e.g.

    building the kit's tiny judge: SFT step 500/8000, agreement 0.912 (stops at 0.98), 35 s

`steadyrl run`, `steadyrl init-model` and `steadyrl serve` log at INFO, so the lines reach the screen
before the run's own progress starts. Details: docs/quickstart.md"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("steadyrl.kit")


class BuildProgress:
    """The progress lines of one build: `step` for each unit of work (shown when due, or at once
    with `now`), `built` at the end."""

    def __init__(self, what: str, every_seconds: float = 5.0) -> None:
        self.what = what
        self.every = every_seconds
        self.started = time.monotonic()
        self.shown = float("-inf")

    def step(self, phase: str, done: int, total: int, note: str = "", now: bool = False) -> None:
        """`done` of `total` units of `phase` are done; `note`: what the last measurement said."""
        at = time.monotonic()
        if not now and at - self.shown < self.every:
            return
        self.shown = at
        said = f", {note}" if note else ""
        log.info("building %s: %s %d/%d%s, %.0f s", self.what, phase, done, total, said, at - self.started)

    def built(self, note: str = "") -> None:
        said = f" ({note})" if note else ""
        log.info("built %s in %.0f s%s", self.what, time.monotonic() - self.started, said)
