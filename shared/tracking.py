"""Experiment tracking: TensorBoard event files (tensorboardX) with the same keys as the JSONL
records, written as each record is, and read back by `read_scalars`; W&B and MLflow when
`TrackingSettings` names them, fed from a thread of their own so that a slow or failing backend
never holds a step. Pure I/O, no service state."""

from __future__ import annotations

import logging
import math
import queue
import struct
import threading
import time
from pathlib import Path

from shared.settings import TrackingSettings

log = logging.getLogger("steadyrl.tracking")
BACKLOG = 10_000  # records waiting for the external backends; beyond it new ones are dropped (counted)
CLOSE_SECONDS = 30.0  # how long close() lets the backends finish what is queued
MAX_FAILURES = 3  # a backend that fails this many records in a row is dropped


def scalars_of(values: dict[str, object]) -> dict[str, float]:
    """The values that are scalars: not a label (the recipe), a bool or a non-finite number."""
    return {k: float(v) for k, v in values.items()
            if not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)}


class ScalarLog:
    """One process's scalars: TensorBoard under `directory` (None: off), plus the backends of
    `tracking` under the name `RUN/service`."""

    def __init__(self, directory: Path | None, tracking: TrackingSettings | None = None, run_id: str = "",
                 service: str = "", out_dir: Path | None = None, config: dict | None = None) -> None:
        self.directory, self._writer = directory, None
        makers = []
        if tracking is not None and tracking.wandb_project:
            makers.append(lambda: WandbBackend(tracking, run_id, service, out_dir or Path("."), config or {}))
        if tracking is not None and tracking.mlflow_tracking_uri:
            makers.append(lambda: MlflowBackend(tracking, run_id, service, config or {}))
        self._external = ExternalBackends(makers) if makers else None

    def add(self, step: int, values: dict[str, object]) -> None:
        scalars = scalars_of(values)
        if self._external is not None:
            self._external.put(step, scalars)
        if self.directory is None:
            return
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.directory), flush_secs=5)
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._external is not None:
            self._external.close()
            self._external = None


class ExternalBackends:
    """W&B / MLflow on one daemon thread: records queue up (at most BACKLOG, then dropped and
    counted); a backend that fails to start, or fails MAX_FAILURES records in a row, is logged and
    dropped (each failed record is logged); close() waits at most CLOSE_SECONDS."""

    def __init__(self, makers: list) -> None:
        self._queue: queue.Queue = queue.Queue(BACKLOG)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, args=(makers,), name="tracking", daemon=True)
        self._thread.start()

    def put(self, step: int, scalars: dict[str, float]) -> None:
        try:
            self._queue.put_nowait((step, scalars))
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        try:
            self._queue.put(None, timeout=CLOSE_SECONDS)
        except queue.Full:
            log.warning("event=tracking_close_timeout backlog=%d", self._queue.qsize())
            return
        self._thread.join(CLOSE_SECONDS)
        if self._thread.is_alive():
            log.warning("event=tracking_close_timeout backlog=%d", self._queue.qsize())
        if self.dropped:
            log.warning("event=tracking_dropped records=%d", self.dropped)

    def _run(self, makers: list) -> None:
        backends = [b for b in (_guarded("start", make) for make in makers) if b is not None]
        failures = dict.fromkeys(backends, 0)
        while (item := self._queue.get()) is not None:
            for backend in list(backends):
                ok = _guarded("log", lambda b=backend: b.log(*item) or True, backend.name,
                              f"step={item[0]} failures={failures[backend] + 1}")  # the count if this one fails
                failures[backend] = 0 if ok else failures[backend] + 1
                if failures[backend] >= MAX_FAILURES:
                    log.error("event=tracking_dropped_backend backend=%s", backend.name)
                    backends.remove(backend)
        for backend in backends:
            _guarded("close", backend.close, backend.name)


def _guarded(phase: str, call, backend: str = "", where: str = ""):
    """`call()`, or None with the error logged: tracking never stops training."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001
        log.error("event=tracking_failed backend=%s phase=%s %s reason=%s", backend or "-", phase, where,
                  f"{type(exc).__name__}: {exc}"[:300])
        return None


def flat(values: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in values.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


class WandbBackend:
    name = "wandb"

    def __init__(self, tracking: TrackingSettings, run_id: str, service: str, out_dir: Path, config: dict) -> None:
        import wandb

        out_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=tracking.wandb_project, entity=tracking.wandb_entity or None,
                              mode=tracking.wandb_mode, group=run_id, job_type=service, name=f"{run_id}/{service}",
                              id=f"{run_id}-{service}", resume="allow", dir=str(out_dir), config=config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowBackend:
    name = "mlflow"

    def __init__(self, tracking: TrackingSettings, run_id: str, service: str, config: dict) -> None:
        import os

        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")  # bounded calls, few retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking.mlflow_tracking_uri)
        experiment = self.client.get_experiment_by_name(tracking.mlflow_experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            tracking.mlflow_experiment)
        tags = {"steadyrl.run_id": run_id, "steadyrl.service": service}
        found = self.client.search_runs([experiment_id], " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items()),
                                        max_results=1)
        self.run_id = found[0].info.run_id if found else self.client.create_run(
            experiment_id, tags=tags, run_name=f"{run_id}/{service}").info.run_id
        if not found:
            from mlflow.entities import Param

            params = [Param(k, str(v)[:500]) for k, v in sorted(flat(config).items())]
            for start in range(0, len(params), 100):  # MLflow's batch limit for params
                self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


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
