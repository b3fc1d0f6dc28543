"""Faults at the worst moment of a `steadyrl run` (the command itself, as a user starts it): Redis
frozen 20 s or the trainer SIGKILLed the moment a checkpoint lands, redis-server killed, a stop
asked through the API. Each run ends with the exit code of its outcome, one metrics line per step
trained, and the mechanism the fault exercises seen in the logs."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from shared.rpc.steadyrl.v1 import common_pb2, orchestrator_pb2_grpc

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
B = 4
G = 8


def start(out: Path, *settings: str) -> subprocess.Popen:
    args = [
        f"run.steps={STEPS}",
        f"run.batch_prompts={B}",
        f"run.group_size={G}",
        "orchestrator.evals.every=0",
        "trainer.checkpoint.every=10",
        *settings,
    ]
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / "tiny-arith.toml"),
            "--out",
            str(out),
            "--progress",
            "plain",
            *(a for s in args for a in ("--set", s)),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(run: subprocess.Popen, done, timeout: float = 300, poll: float = 0.001):
    deadline = time.monotonic() + timeout
    while not (value := done()):
        assert run.poll() is None, run.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(poll)
    return value


def latest_is(out: Path, step: int) -> bool:
    pointer = out / "trainer" / "checkpoints" / "LATEST"
    try:
        return pointer.read_text().strip() == f"step-{step:08d}"
    except FileNotFoundError:
        return False


def freeze_redis_while_the_replica_holds_a_lease(out: Path, redis_pid: int) -> None:
    """SIGSTOP Redis at a moment the replica holds a lease: the replica is stopped first and Redis
    looked at (a completion it sent just before its stop lands meanwhile), then Redis is frozen
    before the replica is let go, so its publish meets the freeze."""
    import redis

    from shared.runstore.keys import RunKeys

    pids = json.loads((out / "pids.json").read_text())
    environ = Path(f"/proc/{pids['trainer']}/environ").read_bytes().split(b"\0")  # the run's Redis, as services see it
    url = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"STEADYRL_TRAINER_REDIS_URL="))
    client = redis.Redis.from_url(url, socket_timeout=2)
    owners = RunKeys("tiny-arith").owners
    replica = pids["inference-0"]
    deadline = time.monotonic() + 120
    try:
        while True:
            os.kill(replica, signal.SIGSTOP)
            try:
                if b"replica-0" in client.hvals(owners):
                    time.sleep(0.2)
                    if b"replica-0" in client.hvals(owners):
                        os.kill(redis_pid, signal.SIGSTOP)
                        return
            finally:
                os.kill(replica, signal.SIGCONT)
            assert time.monotonic() < deadline, "the replica never held a lease"
            time.sleep(0.005)
    finally:
        client.close()


def control_plane(out: Path) -> tuple[str, str, str]:
    """(HTTP base URL, gRPC address, token) of the run's orchestrator, from its log."""
    line = re.search(
        r"event=started service=orchestrator port=(\d+) .*http_port=(\d+)",
        (out / "logs" / "orchestrator.log").read_text(),
    )
    return f"http://127.0.0.1:{line[2]}", f"127.0.0.1:{line[1]}", (out / "token").read_text().strip()


def metric_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]


def finished_cleanly(run: subprocess.Popen, out: Path) -> str:
    stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == STEPS, summary
    assert metric_steps(out) == list(range(1, STEPS + 1))  # one line per step trained: none lost, none twice
    return stderr


def test_redis_frozen_20s_as_a_checkpoint_lands(tmp_path):
    """The control plane answers through the freeze (GET /v1/run never 5xx: the last status, marked
    stale; a pause refused with 503 and Retry-After, never applied after; gRPC Status UNAVAILABLE);
    the trainer's step-10 line was written before its checkpoint acknowledged anything; a replica's
    publish that Redis did not answer is tried again when it thaws, its leases kept (none expires)."""
    out = tmp_path / "run"
    # the replica is the bottleneck (one task at a time, a backlog queued); Redis freezes while it holds a lease
    run = start(out, "inference.tasks.max_inflight=1", "inference.tasks.per_batch=1", "run.max_staleness=2")
    try:
        wait_for(run, lambda: latest_is(out, 10))
        redis_pid = json.loads((out / "pids.json").read_text())["redis-server"]
        freeze_redis_while_the_replica_holds_a_lease(out, redis_pid)
        try:
            url, address, token = control_plane(out)
            headers = {"Authorization": f"Bearer {token}"}
            gets = []
            pause = None
            status_code = None
            frozen_at = time.monotonic()
            while time.monotonic() - frozen_at < 20:
                reply = httpx.get(f"{url}/v1/run", headers=headers, timeout=10)
                gets.append((reply.status_code, "stale" in reply.json()))
                if pause is None:
                    pause = httpx.post(f"{url}/v1/run/pause", headers=headers, timeout=10)
                    with grpc.insecure_channel(address) as channel:
                        try:
                            orchestrator_pb2_grpc.OrchestratorStub(channel).Status(
                                common_pb2.Empty(), metadata=[("authorization", f"Bearer {token}")], timeout=10
                            )
                            status_code = grpc.StatusCode.OK
                        except grpc.RpcError as exc:
                            status_code = exc.code()
                time.sleep(0.5)
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        stderr = finished_cleanly(run, out)  # finished: the refused pause was never applied
    finally:
        if run.poll() is None:
            run.kill()
    assert gets and all(code == 200 and stale for code, stale in gets), gets
    assert pause.status_code == 503 and pause.headers["Retry-After"] == "4" and "detail" in pause.json()
    assert status_code == grpc.StatusCode.UNAVAILABLE
    trainer = (out / "logs" / "trainer.log").read_text()
    assert "event=redis_unreachable" in trainer  # the freeze met the trainer after its checkpoint
    replica = (out / "logs" / "inference-0.log").read_text()
    assert re.search(r"event=send_failed tasks=\d+ error=\w+ retry=true", replica)
    assert "event=send_retried" in replica and "event=lease_lost" not in replica
    assert "event=leases_expired" not in (out / "logs" / "orchestrator.log").read_text()
    assert "event=service_restarted" not in stderr


def test_trainer_killed_as_a_checkpoint_lands(tmp_path):
    """SIGKILL right after LATEST names step 10: the supervisor restarts the trainer, which resumes
    from that checkpoint; step 10's line was on disk before the checkpoint, steps past it that the
    kill took back are trained again and written once."""
    out = tmp_path / "run"
    run = start(out)
    try:
        wait_for(run, lambda: latest_is(out, 10))
        os.kill(json.loads((out / "pids.json").read_text())["trainer"], signal.SIGKILL)
        steps_at_kill = metric_steps(out)
        stderr = finished_cleanly(run, out)
    finally:
        if run.poll() is None:
            run.kill()
    assert steps_at_kill[:10] == list(range(1, 11))
    assert re.search(r"event=service_restarted service=trainer", stderr)
    assert "event=resumed checkpoint=step-00000010 step=10" in (out / "logs" / "trainer.log").read_text()


def test_redis_server_is_supervised_like_every_service(tmp_path):
    """redis-server SIGKILLed: restarted after the backoff from its AOF, logged; with max_restarts = 0
    the run fails instead, exit code 1, naming it."""
    out = tmp_path / "run"
    run = start(out, "run.restart_backoff_seconds=0.5")
    try:
        wait_for(
            run,
            lambda: (
                len((out / "trainer" / "metrics.jsonl").read_text().splitlines()) >= 3
                if (out / "trainer" / "metrics.jsonl").exists()
                else False
            ),
            poll=0.05,
        )
        os.kill(json.loads((out / "pids.json").read_text())["redis-server"], signal.SIGKILL)
        stderr = finished_cleanly(run, out)
    finally:
        if run.poll() is None:
            run.kill()
    assert re.search(r"event=service_exited service=redis-server code=-9 restart_in=0\.5s restarts=0/5", stderr)
    assert re.search(r"event=service_restarted service=redis-server pid=\d+ restarts=1/5", stderr)

    out = tmp_path / "fails"
    run = start(out, "run.max_restarts=0", "run.steps=100000")
    try:
        wait_for(run, lambda: (out / "pids.json").exists(), poll=0.05)
        os.kill(json.loads((out / "pids.json").read_text())["redis-server"], signal.SIGKILL)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "failed" and summary["error"].startswith(
        "redis-server exited with -9 after 0 restarts"
    )


def test_a_run_stopped_through_the_api_exits_3(tmp_path):
    out = tmp_path / "run"
    run = start(out, "run.steps=100000")
    try:
        wait_for(run, lambda: (out / "trainer" / "metrics.jsonl").exists(), poll=0.05)
        url, _, token = control_plane(out)
        assert (
            httpx.post(f"{url}/v1/run/stop", headers={"Authorization": f"Bearer {token}"}).json()["state"] == "stopped"
        )
        stdout, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 3, stderr[-2000:]
    assert json.loads(stdout.splitlines()[-1])["outcome"] == "stopped"
    assert json.loads((out / "summary.json").read_text())["outcome"] == "stopped"
