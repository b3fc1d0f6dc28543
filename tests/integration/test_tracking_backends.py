"""W&B (offline) and MLflow (a local store) behind `TrackingSettings`: the real libraries, what
they were given read back from what they wrote; a backend that fails never stops the scalars."""

import json
import logging
import math
import re
import time

import pytest

from shared.runtime.settings import TrackingSettings
from shared.runtime.tracking import ScalarLog
from tests.helpers import mlflow_history, read_scalars, wandb_history

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a store on disk: no server here
    monkeypatch.setenv("WANDB_SILENT", "true")
    return f"file://{tmp_path / 'mlruns'}"


def test_wandb_and_mlflow_get_every_scalar_per_step(tmp_path, mlflow_store):
    tracking = TrackingSettings(
        wandb_project="steadyrl-test", wandb_mode="offline", mlflow_tracking_uri=mlflow_store, mlflow_experiment="grid"
    )
    config = {"lr": 0.001, "loss": {"eps_low": 0.2}, "redis_url": "**********"}
    log = ScalarLog(tmp_path / "tb", tracking, "exp-1", "trainer", tmp_path / "out", config)
    log.add(1, {"reward_mean": 0.25, "tokens": 100, "recipe": "minirl+tis", "loss": math.nan})
    log.add(2, {"reward_mean": 0.5, "tokens": 120, "eval_set/hard/accuracy": 0.75})
    log.close()
    expected = {
        "reward_mean": [(1, 0.25), (2, 0.5)],
        "tokens": [(1, 100.0), (2, 120.0)],
        "eval_set/hard/accuracy": [(2, 0.75)],
    }
    assert read_scalars(tmp_path / "tb") == expected
    assert wandb_history(tmp_path / "out") == expected
    from tests.helpers import wandb_records

    run = next(r.run for r in wandb_records(tmp_path / "out") if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.run_group, run.display_name, run.project) == (
        "exp-1-trainer",
        "exp-1",
        "exp-1/trainer",
        "steadyrl-test",
    )
    metrics, params = mlflow_history(mlflow_store, "exp-1/trainer")
    assert metrics == expected
    assert params == {"lr": "0.001", "loss.eps_low": "0.2", "redis_url": "**********"}


def test_a_failing_backend_is_logged_and_dropped_and_tensorboard_goes_on(tmp_path, monkeypatch, caplog):
    from shared.runtime.tracking import START_ATTEMPTS
    from steadyrl.summary import tracking_status

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    tracking = TrackingSettings(mlflow_tracking_uri="http://127.0.0.1:9")  # nothing listens on the discard port
    log = ScalarLog(tmp_path / "tb", tracking, "exp-2", "orchestrator", tmp_path / "orchestrator")
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="steadyrl.tracking"):
        for step in range(3):
            log.add(step, {"eval_accuracy": step / 4})
        log.close()
    assert time.monotonic() - started < 60  # close() is bounded (CLOSE_SECONDS); generous on a loaded machine
    assert read_scalars(tmp_path / "tb") == {"eval_accuracy": [(0, 0.0), (1, 0.25), (2, 0.5)]}
    failures = [r.getMessage() for r in caplog.records if "event=tracking_failed" in r.getMessage()]
    assert len(failures) == START_ATTEMPTS and all("phase=start" in f for f in failures)
    status = tracking_status(tmp_path)  # what the run's summary.json says of it
    assert list(status) == ["orchestrator"] and status["orchestrator"]["mlflow"].startswith(
        f"failed to start ({START_ATTEMPTS} tries): "
    )


def test_two_services_making_the_mlflow_experiment_at_once_both_log(tmp_path, monkeypatch):
    """The trainer's and the orchestrator's backends start together on a fresh
    store; the one whose create loses the race finds the other's experiment and logs to it."""
    from mlflow import MlflowClient

    from shared.runtime.tracking import MlflowBackend

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = f"file://{tmp_path / 'mlruns'}"
    lookup = MlflowClient.get_experiment_by_name

    def raced(self, name):  # the other service makes the experiment between this one's look and its create
        found = lookup(self, name)
        if found is None:
            MlflowClient(tracking_uri=store).create_experiment(name)
        return found

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", raced)
    tracking = TrackingSettings(mlflow_tracking_uri=store, mlflow_experiment="raced")
    backend = MlflowBackend(tracking, "exp-race", "trainer", {})
    backend.log(1, {"reward_mean": 0.5})
    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", lookup)
    experiment = MlflowClient(tracking_uri=store).get_experiment_by_name("raced")
    history = MlflowClient(tracking_uri=store).get_metric_history(backend.run_id, "reward_mean")
    assert experiment is not None and [(m.step, m.value) for m in history] == [(1, 0.5)]


def test_a_backend_that_fails_to_start_once_is_tried_again(tmp_path):
    from shared.runtime.tracking import ExternalBackends

    class Recorder:
        name = "recorder"
        logged: list = []

        def log(self, step, scalars):
            self.logged.append((step, scalars))

        def close(self):
            pass

    tries = []

    def make():
        tries.append(1)
        if len(tries) == 1:
            raise ConnectionError("the tracking server is still starting")
        return Recorder()

    backends = ExternalBackends({"recorder": make}, tmp_path / "tracking.json")
    backends.put(3, {"x": 1.0})
    backends.close()
    assert len(tries) == 2 and Recorder.logged == [(3, {"x": 1.0})]
    assert json.loads((tmp_path / "tracking.json").read_text()) == {"recorder": "ok"}


def test_tracking_settings_reach_both_services_and_are_checked(monkeypatch):
    from pathlib import Path

    from steadyrl.recipe import load_recipe
    from steadyrl.service_settings import service_env

    root = Path(__file__).resolve().parents[2]
    config = load_recipe(root / "configs" / "tiny-arith.toml", ['run.tracking={wandb_project = "p"}'])
    for service in ("trainer", "orchestrator"):
        env = service_env(config, service)
        assert env[f"STEADYRL_{service.upper()}_TRACKING__WANDB_PROJECT"] == "p"
    assert not any("TRACKING" in k for k in service_env(config, "inference"))
    with pytest.raises(ValueError, match="which \\[run\\] declares"):
        load_recipe(root / "configs" / "tiny-arith.toml", ['trainer.tracking={wandb_project = "p"}'])
    with pytest.raises(ValueError, match="wandb_mode"):
        TrackingSettings(wandb_mode="sometimes")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    install = re.escape(".venv/bin/pip install -e '.[mlflow]'")  # what works in a clone: no steadyrl on PyPI
    with pytest.raises(
        ValueError, match=f"tracking.mlflow_tracking_uri needs mlflow: from the repository root, {install}"
    ):
        TrackingSettings(mlflow_tracking_uri="http://mlflow:5000")


def test_a_backend_failing_records_in_a_row_is_dropped(tmp_path, mlflow_store, caplog):
    """MLflow's file store cannot hold `x/y` once `x` exists: each such record fails, a good one in
    between resets the count, and MAX_FAILURES failures in a row drop the backend."""
    from shared.runtime.tracking import MAX_FAILURES

    log = ScalarLog(None, TrackingSettings(mlflow_tracking_uri=mlflow_store), "exp-3", "trainer")
    records = [{"x": 1.0}, {"x/y": 1.0}, {"x": 2.0}, *[{"x/y": 1.0}] * MAX_FAILURES, {"x": 3.0}]
    with caplog.at_level(logging.ERROR, logger="steadyrl.tracking"):
        for step, values in enumerate(records):
            log.add(step, values)
        log.close()
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split("failures=")[1].split()[0] for m in messages if "phase=log" in m] == ["1", "1", "2", "3"]
    assert sum("event=tracking_dropped_backend backend=mlflow" in m for m in messages) == 1
    assert mlflow_history(mlflow_store, "exp-3/trainer")[0] == {"x": [(0, 1.0), (2, 2.0)]}  # nothing after the drop


def test_a_restarted_service_continues_its_runs(tmp_path, mlflow_store):
    """A restarted trainer logs into the same MLflow run (found by its tags) and the same W&B run id."""
    from tests.helpers import wandb_records

    tracking = TrackingSettings(wandb_project="steadyrl-test", wandb_mode="offline", mlflow_tracking_uri=mlflow_store)
    for steps in ([1, 2], [3, 4]):  # the first process, then the restarted one
        if steps[0] > 1:  # W&B names an offline run's folder by its start second and id: a restart within the same
            started = int(time.time())  # second (never a real one's) would write over the first's records
            while int(time.time()) == started:
                time.sleep(0.05)
        log = ScalarLog(None, tracking, "exp-4", "trainer", tmp_path / "out", {"lr": 0.001})
        for step in steps:
            log.add(step, {"reward_mean": step / 10})
        log.close()
    assert mlflow_history(mlflow_store, "exp-4/trainer")[0] == {"reward_mean": [(s, s / 10) for s in (1, 2, 3, 4)]}
    runs = [r.run for r in wandb_records(tmp_path / "out") if r.WhichOneof("record_type") == "run"]
    assert len(runs) == 2 and {r.run_id for r in runs} == {"exp-4-trainer"}  # `wandb sync` joins them
    assert wandb_history(tmp_path / "out") == {"reward_mean": [(s, s / 10) for s in (1, 2, 3, 4)]}
