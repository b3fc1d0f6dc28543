"""Experiment tracking: TensorBoard event files (tensorboardX) with the same keys as the JSONL
records, written as each record is, and read back by `read_scalars`. Pure I/O, no service state."""

from __future__ import annotations

import logging
import math
import struct
from pathlib import Path

log = logging.getLogger("steadyrl.tracking")


class ScalarLog:
    """One process's TensorBoard scalars under `directory` (None: off)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory, self._writer = directory, None

    def add(self, step: int, values: dict[str, object]) -> None:
        if self.directory is None:
            return
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.directory), flush_secs=5)
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue  # a label (the recipe) or a non-finite value is no scalar
            self._writer.add_scalar(key, float(value), step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under `directory`: tag → [(step, value)] in file order."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):  # TFRecord: length (8), its CRC (4), payload, payload CRC (4)
            (length,) = struct.unpack("<Q", data[at : at + 8])
            payload = data[at + 12 : at + 12 + length]
            at += 12 + length + 4
            if len(payload) < length:
                break  # a record cut short by a crash
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars
