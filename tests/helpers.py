"""Helpers several tests share: publishing rollouts the way replicas do."""

from __future__ import annotations

import contextlib
import dataclasses
import struct
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch

from shared.rollouts.record import Rollout, encode_rollout
from shared.rpc.steadyrl.v1 import common_pb2
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.runstore.queues import WorkQueue
from shared.weightsync.grpc import GrpcDelivery
from shared.weightsync.manifest import bytes_to_tensor, describe, tensor_to_bytes


async def publish(redis, run_id: str, rollouts: list[Rollout], replica: str = "rec") -> None:
    """Publish rollouts through the work queue, as a replica does: each task's rollouts under the
    lease that completes it (a task is submitted, leased and completed per distinct task id)."""
    queue = WorkQueue(redis, run_id)
    by_task: dict[str, list[bytes]] = defaultdict(list)
    for r in rollouts:
        by_task[r.task_id].append(encode_rollout(dataclasses.replace(r, run_id=run_id)))
    for task_id, payloads in by_task.items():
        assert await submit(queue, common_pb2.PromptTask(task_id=task_id, run_id=run_id))
        [lease] = await queue.lease(replica, 600)
        assert lease.task_id == task_id
        assert await queue.complete(replica, task_id, payloads)


@contextlib.contextmanager
def running(config, out: Path, model_dir, past_version: int = 2):
    """The whole system of `config` on loopback (processes started by their pids), its run
    started and the trainer past `past_version`; every process stopped on the way out."""
    from steadyrl.processes import Launch

    launch = Launch(config, out, str(model_dir))
    try:
        launch.start_all()
        launch.api("POST", "/v1/run/start")
        while launch.api("GET", "/v1/run")["trainer_version"] < past_version:
            time.sleep(0.02)
        yield launch
    finally:
        launch.stop_all()


def wait_until(launch, done, timeout: float = 300) -> dict:
    """Poll the control plane until done(status); the status then."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = launch.api("GET", "/v1/run")
        except Exception:  # noqa: BLE001 - the control plane may be reconnecting to Redis
            status = {}
        if status and done(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


def wandb_records(directory: Path) -> list:
    """The records of every W&B offline run under `directory` (their `.wandb` files: W&B's 7-byte
    header, then LevelDB log blocks of protobuf `Record`s), in the order the runs were written."""
    import struct

    from wandb.proto import wandb_internal_pb2

    out = []
    for path in sorted(Path(directory).rglob("run-*.wandb"), key=lambda p: p.stat().st_mtime_ns):  # run order
        data = path.read_bytes()
        at = 7
        parts = b""
        assert data[:4] == b":W&B", path
        while at + 7 <= len(data):
            if 32768 - at % 32768 < 7:  # a block's tail too short for a chunk header is padding
                at += 32768 - at % 32768
                continue
            _crc, length, kind = struct.unpack("<IHB", data[at : at + 7])
            chunk = data[at + 7 : at + 7 + length]
            at = at + 7 + length
            if kind == 0:
                continue
            parts = chunk if kind in (1, 2) else parts + chunk  # FULL / FIRST start a record
            if kind in (1, 4):  # FULL / LAST end one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(parts)
                out.append(record)
    return out


def wandb_history(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """key → [(step, value)] logged to the W&B offline runs under `directory`."""
    import json

    history: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for record in wandb_records(directory):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    history[key].append((items["_step"], value))
    return dict(history)


def mlflow_history(uri: str, run_name: str) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    """(metric → [(step, value)], params) of the MLflow run named `run_name`."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], f"attributes.run_name = '{run_name}'"
    )
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    metrics = {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
        for key in run.data.metrics
    }
    return metrics, run.data.params


def weight_keys(directory: Path, run_id: str = ""):
    """A fresh weight-signing key pair: (the `Signer` a test's trainer publishes with, the public
    key file weight-sync and the replicas verify with)."""
    from shared.weightsync.signing import Signer, write_key_pair

    private, public = write_key_pair(directory / "keys")
    return Signer.from_file(private, run_id), public


async def submit(queue: WorkQueue, task: common_pb2.PromptTask) -> bool:
    """Queue one task; False when a task with its id is already queued or leased."""
    return (await queue.submit_many([task]))[0]


def build_manifest(
    tensors: Mapping[str, torch.Tensor], version: int, parent_version: int, signer=None
) -> tuple[pb.WeightManifest, list[memoryview]]:
    """`describe(tensors, ...)` and the raw bytes of every tensor (all held at once)."""
    return describe(tensors, version, parent_version, signer), [tensor_to_bytes(tensors[name]) for name in tensors]


def pull_all(
    address: str, version: int, base_version: int = 0, base=None
) -> tuple[pb.WeightManifest, list[bytearray], int]:
    """A whole version pulled at once: (manifest, every tensor's checked bytes, wire bytes)."""
    delivery = GrpcDelivery(address, version, base_version=base_version, base=base)
    payloads = [data for _, data in delivery.tensors()]
    return delivery.manifest, payloads, delivery.wire_bytes


def to_state_dict(manifest: pb.WeightManifest, payloads: list[bytearray]) -> dict[str, torch.Tensor]:
    return {s.name: bytes_to_tensor(d, s.dtype, list(s.shape)) for s, d in zip(manifest.tensors, payloads, strict=True)}


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under `directory`: tag → [(step, value)] in file order."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
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


@dataclasses.dataclass
class KilledRun:
    """A `steadyrl run` with services SIGKILLed mid-run: its exit code, stdout, stderr, and the step of
    the trainer's last metrics line before the kill."""

    returncode: int
    stdout: str
    stderr: str
    killed_at: int


def kill_mid_run(
    recipe: Path, out: Path, settings: list[str], after_lines: int, victims: list[str], sig: int = 9
) -> KilledRun:
    """Start `steadyrl run RECIPE --out OUT --set ...`, wait (up to 300 s) for `after_lines` lines of the
    trainer's metrics.jsonl, send `sig` (SIGKILL) to the services named in `victims` (by the run's pids.json)
    and wait (up to 600 s) for the run to end; it is killed if it has not."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    run = subprocess.Popen(
        [sys.executable, "-m", "steadyrl.cli", "run", str(recipe), "--out", str(out), "--progress", "none"]
        + [a for s in settings for a in ("--set", s)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / "trainer" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while not metrics.exists() or len(metrics.read_text().splitlines()) < after_lines:
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read() if run.poll() else ""
            time.sleep(0.05)
        killed_at = json.loads(metrics.read_text().splitlines()[-1])["step"]
        pids = json.loads((out / "pids.json").read_text())
        for name in victims:
            os.kill(pids[name], sig)
        stdout, stderr = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    return KilledRun(run.returncode, stdout, stderr, killed_at)


def steadyrl_run(recipe: str, out: Path, settings: list[str], timeout: float = 600, progress: str = "plain"):
    """`steadyrl run RECIPE --out OUT --set …` as a user types it (configs/RECIPE, from the repo root):
    the finished process, its output captured."""
    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "steadyrl.cli", "run", str(root / "configs" / recipe), "--out", str(out)]
    argv += ["--progress", progress, *(part for setting in settings for part in ("--set", setting))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=root)
