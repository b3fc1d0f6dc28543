"""Experiment tracking: TensorBoard event files (tensorboardX) with the same keys as the JSONL
records, written as each record is; W&B and MLflow when
`TrackingSettings` names them, fed from a thread of their own so that a slow or failing backend
never holds a step; what became of each backend is written to `tracking.json` beside the
service's records, for the run's summary. Pure I/O, no service state."""

from __future__ import annotations

import json
import logging
import math
import queue
import sys
import threading
import time
from pathlib import Path

from shared.runtime.settings import TrackingSettings

log = logging.getLogger("steadyrl.tracking")
BACKLOG = 10_000  # records waiting for the external backends; beyond it new ones are dropped (counted)
CLOSE_SECONDS = 30.0  # how long close() lets the backends finish what is queued
MAX_FAILURES = 3  # a backend that fails this many records in a row is dropped
START_ATTEMPTS = 3  # a backend that fails to start is tried this many times, 2 s apart, then dropped
STATUS_FILE = "tracking.json"  # what became of each backend, beside the service's records


def scalars_of(values: dict[str, object]) -> dict[str, float]:
    """The values that are scalars: not a label (the recipe), a bool or a non-finite number."""
    return {
        k: float(v)
        for k, v in values.items()
        if not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
    }


def summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch in a process that has none loaded: its
    writer imports torch only to accept torch tensors (this module hands it floats), and torch would
    cost a service that never computes (the orchestrator) ~1 s of CPU at start-up and ~200 MB."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError there, which tensorboardX catches
    try:
        from tensorboardX import SummaryWriter
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
    return SummaryWriter


class ScalarLog:
    """One process's scalars: TensorBoard under `directory` (None: off), plus the backends of
    `tracking` under the name `RUN/service`."""

    def __init__(
        self,
        directory: Path | None,
        tracking: TrackingSettings | None = None,
        run_id: str = "",
        service: str = "",
        out_dir: Path | None = None,
        config: dict | None = None,
    ) -> None:
        self.directory = directory
        self._writer = None
        makers = {}
        if tracking is not None and tracking.wandb_project:
            makers["wandb"] = lambda: WandbBackend(tracking, run_id, service, out_dir or Path("."), config or {})
        if tracking is not None and tracking.mlflow_tracking_uri:
            makers["mlflow"] = lambda: MlflowBackend(tracking, run_id, service, config or {})
        status = out_dir / STATUS_FILE if out_dir is not None else None
        self._external = ExternalBackends(makers, status) if makers else None

    def add(self, step: int, values: dict[str, object]) -> None:
        scalars = scalars_of(values)
        if self._external is not None:
            self._external.put(step, scalars)
        if self.directory is None:
            return
        if self._writer is None:
            SummaryWriter = summary_writer_class()  # noqa: N806 - a class
            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.directory), flush_secs=5)
        if scalars:  # one event per step with every value (an event each cost a queue put and a pickle)
            from tensorboardX.proto.summary_pb2 import Summary

            # the values as tensorboardX's `scalar` makes them, without its per-value numpy round trip
            values = [Summary.Value(tag=key, simple_value=value) for key, value in scalars.items()]
            self._writer._get_file_writer().add_summary(Summary(value=values), step)

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
    counted); a backend that fails to start START_ATTEMPTS times, or fails MAX_FAILURES records in
    a row, is logged and dropped (each failed record is logged); close() waits at most
    CLOSE_SECONDS. `status` (a JSON file): each backend's `ok`, or why it was dropped."""

    def __init__(self, makers: dict, status: Path | None = None) -> None:
        self._queue: queue.Queue = queue.Queue(BACKLOG)
        self.dropped = 0
        self.status_path = status
        self.status = {}
        self._thread = threading.Thread(target=self._run, args=(makers,), name="tracking", daemon=True)
        self._thread.start()

    def _record(self, name: str, state: str) -> None:
        self.status[name] = state
        if self.status_path is not None:
            try:
                self.status_path.parent.mkdir(parents=True, exist_ok=True)
                self.status_path.write_text(json.dumps(self.status, indent=1))
            except OSError as exc:
                log.warning("event=tracking_status_unwritten path=%s error=%s", self.status_path, exc)

    def _start(self, name: str, make):
        """The backend, started within START_ATTEMPTS tries (None: dropped, with the reason kept)."""
        for attempt in range(1, START_ATTEMPTS + 1):
            error = []
            backend = _guarded("start", make, name, f"attempt={attempt}", error)
            if backend is not None:
                self._record(name, "ok")
                return backend
            if attempt < START_ATTEMPTS:
                time.sleep(2.0)
        self._record(name, f"failed to start ({START_ATTEMPTS} tries): {error[0]}")
        return None

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

    def _run(self, makers: dict) -> None:
        backends = [b for b in (self._start(name, make) for name, make in makers.items()) if b is not None]
        failures = dict.fromkeys(backends, 0)
        while (item := self._queue.get()) is not None:
            for backend in list(backends):
                error = []
                ok = _guarded(
                    "log",
                    lambda b=backend: b.log(*item) or True,
                    backend.name,
                    f"step={item[0]} failures={failures[backend] + 1}",
                    error,
                )  # the count if this one fails
                failures[backend] = 0 if ok else failures[backend] + 1
                if failures[backend] >= MAX_FAILURES:
                    log.error("event=tracking_dropped_backend backend=%s", backend.name)
                    self._record(
                        backend.name, f"dropped at step {item[0]} after {MAX_FAILURES} failed records: {error[0]}"
                    )
                    backends.remove(backend)
        for backend in backends:
            _guarded("close", backend.close, backend.name)


def _guarded(phase: str, call, backend: str = "", where: str = "", error: list | None = None):
    """`call()`, or None with the error logged (and appended to `error`): tracking never stops
    training."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - a tracking backend's own failure, whatever it is
        reason = f"{type(exc).__name__}: {exc}"[:300]
        log.error("event=tracking_failed backend=%s phase=%s %s reason=%s", backend or "-", phase, where, reason)
        if error is not None:
            error.append(reason)
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
        self.run = wandb.init(
            project=tracking.wandb_project,
            entity=tracking.wandb_entity or None,
            mode=tracking.wandb_mode,
            group=run_id,
            job_type=service,
            name=f"{run_id}/{service}",
            id=f"{run_id}-{service}",
            resume="allow",
            dir=str(out_dir),
            config=config,
        )

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
        experiment_id = self.experiment(tracking.mlflow_experiment)
        tags = {"steadyrl.run_id": run_id, "steadyrl.service": service}
        found = self.client.search_runs(
            [experiment_id], " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items()), max_results=1
        )
        self.run_id = (
            found[0].info.run_id
            if found
            else self.client.create_run(experiment_id, tags=tags, run_name=f"{run_id}/{service}").info.run_id
        )
        if not found:
            from mlflow.entities import Param

            params = [Param(k, str(v)[:500]) for k, v in sorted(flat(config).items())]
            for start in range(0, len(params), 100):  # MLflow's batch limit for params
                self.client.log_batch(self.run_id, params=params[start : start + 100])

    def experiment(self, name: str) -> str:
        """The experiment's id, made when missing: another service may make it at the same moment
        (the trainer's and the orchestrator's backends start together), so a refusal to make it
        is followed by looking it up again."""
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
