"""Fault benchmark: what a fault costs in time, against the bound the settings set. The tests hold the
outcomes (the next replica answers, the run finishes whole); how long it took is measured here, on
real processes, and printed as ratios. One JSON object: `teacher_pool` (a frozen teacher replica's
attempts over their timeouts) and `collective` (the slowest step of a run whose replica froze mid
broadcast, over the collective timeout).

Details: docs/internals/bench.md"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ATTEMPT_SECONDS = 2.0  # the teacher pool's attempt timeout
COLLECTIVE_TIMEOUT = 5.0  # weightsync.collective_timeout_seconds of the collective run


def teacher_replica(model_dir: str, port: int, name: str, metrics_port: int = 0) -> subprocess.Popen:
    """A teacher pool replica (services.inference, pool "teacher") on `port`, one torch thread."""
    env = {
        **os.environ,
        "STEADYRL_INFERENCE_MODEL_PATH": str(model_dir),
        "STEADYRL_INFERENCE_DTYPE": "float32",
        "STEADYRL_INFERENCE_POOL": "teacher",
        "STEADYRL_INFERENCE_PORT": str(port),
        "STEADYRL_INFERENCE_METRICS_PORT": str(metrics_port),
        "STEADYRL_INFERENCE_REPLICA_ID": name,
        "STEADYRL_INFERENCE_TORCH_THREADS": "1",
    }
    return subprocess.Popen([sys.executable, "-m", "services.inference"], env=env, stdout=subprocess.DEVNULL)


def wait_serving(port: int, deadline: float = 180.0) -> None:
    """Until the gRPC health of the server on `port` says SERVING (TimeoutError after `deadline`)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + deadline
    while time.monotonic() < end:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.2)
    raise TimeoutError(f"no teacher serving on {port} after {deadline:.0f} s")


def teacher_pool(model_dir: str, rounds: int = 3) -> dict:
    """`rounds` times: teacher-0 frozen, three Score calls (starting on the dead address, on the frozen
    replica, on the live one: two meet the frozen replica once each), thawed; the median of their
    seconds over two attempt timeouts."""
    from shared.rpc.pool_client import PoolClient
    from shared.rpc.steadyrl.v1 import inference_pb2 as pb
    from shared.rpc.steadyrl.v1 import inference_pb2_grpc
    from shared.runstore.redis_server import free_port

    dead, a, b = (free_port() for _ in range(3))
    replicas = [teacher_replica(model_dir, a, "teacher-0"), teacher_replica(model_dir, b, "teacher-1")]
    request = pb.ScoreRequest(
        sequences=[pb.ScoreSequence(prompt_token_ids=[1, 5, 6, 7], completion_token_ids=[4, 5, 7, 7, 6, 5])], top_k=3
    )
    try:
        wait_serving(a)
        wait_serving(b)

        async def measure() -> list[float]:
            addresses = [f"127.0.0.1:{port}" for port in (dead, a, b)]
            client = PoolClient("teacher", addresses, inference_pb2_grpc.InferenceStub, ATTEMPT_SECONDS, 3, 0.05)
            seconds = []
            try:
                await client.call("Score", request)  # every channel tried once: connected, warm
                for _ in range(rounds):
                    os.kill(replicas[0].pid, signal.SIGSTOP)
                    try:
                        started = time.monotonic()
                        for _ in addresses:
                            await client.call("Score", request)
                        seconds.append(time.monotonic() - started)
                    finally:
                        os.kill(replicas[0].pid, signal.SIGCONT)
                    await asyncio.sleep(0.5)
            finally:
                await client.close()
            return seconds

        seconds = asyncio.run(asyncio.wait_for(measure(), 300))
    finally:
        for replica in replicas:
            replica.terminate()
            replica.wait(30)
    return {
        "attempt_timeout_seconds": ATTEMPT_SECONDS,
        "rounds": rounds,
        "three_calls_seconds": [round(s, 3) for s in seconds],
        "median_over_two_timeouts": round(statistics.median(seconds) / (2 * ATTEMPT_SECONDS), 3),
        "bound": "two frozen attempts, each ended by its timeout, and nothing else waits: about 1",
    }


def step_times(trainer_log: str) -> list[float]:
    """Each step's seconds from its batch to its version published (the trainer's log). Pure."""
    return [float(s) for s in re.findall(r"event=step .* seconds=([\d.]+)$", trainer_log, re.MULTILINE)]


def collective(model_dir: str, steps: int = 30) -> dict:
    """The demo on the collective transport, two replicas, run as a user runs it (`steadyrl run`);
    inference-0 frozen while a broadcast waits on it, then killed (the run's supervisor starts it
    again): the slowest step over the collective timeout, beside the median step."""
    settings = [
        f"run.steps={steps}",
        "run.batch_prompts=4",
        "run.group_size=8",
        "run.replicas=2",
        "orchestrator.evals.every=0",
        "trainer.checkpoint.every=1",
        "inference.tasks.lease_seconds=3",
        "inference.tasks.per_batch=2",
        "trainer.publish.transport=collective",
        f"weightsync.collective_timeout_seconds={COLLECTIVE_TIMEOUT}",
        f'model.path="{model_dir}"',
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        weightsync_log = out / "logs" / "weightsync.log"
        trainer_log = out / "logs" / "trainer.log"
        command = [str(Path(sys.executable).with_name("steadyrl")), "run", str(ROOT / "configs" / "tiny-arith.toml")]
        command += ["--out", str(out), "--progress", "none", *(a for s in settings for a in ("--set", s))]
        run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            until(lambda: "event=step step=4 " in trainer_log.read_text(), 300)
            announced = weightsync_log.read_text().count("members=2")
            victim = json.loads((out / "pids.json").read_text())["inference-0"]
            os.kill(victim, signal.SIGSTOP)  # a member stops answering, a broadcast waits on it ...

            def waiting() -> bool:  # the next version announced to both, or the group formed without it
                text = weightsync_log.read_text()
                return text.count("members=2") > announced or "members=1" in text

            until(waiting, 60)
            time.sleep(1.0)
            os.kill(victim, signal.SIGKILL)  # ... and it dies in the middle of it
            run.wait(600)
            text = trainer_log.read_text()
            seconds = step_times(text)
            failed = len(re.findall(r"event=collective_failed", text + weightsync_log.read_text()))
        finally:
            if run.poll() is None:
                run.terminate()
                run.wait(60)
    return {
        "collective_timeout_seconds": COLLECTIVE_TIMEOUT,
        "steps": len(seconds),
        "failed_broadcasts": failed,  # logged by the trainer or weight-sync, whichever sent to the dead member
        "slowest_step_seconds": max(seconds),
        "median_step_seconds": statistics.median(seconds),
        "slowest_over_timeout": round(max(seconds) / COLLECTIVE_TIMEOUT, 3),
        "bound": "one bounded timeout for the dead member: at most about 2 (≤ 2 × timeout + 10 s is 4)",
    }


def until(done, seconds: float) -> None:
    """Poll `done()` until it holds; TimeoutError after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if done():
                return
        except Exception:  # noqa: BLE001 - a control plane or a log not up yet: ask again
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done in {seconds:.0f} s")
        time.sleep(0.1)


def main() -> dict:
    from shared.kit.tiny import init_tiny_model

    model_dir = str(init_tiny_model())
    return {"benchmark": "faults", "teacher_pool": teacher_pool(model_dir), "collective": collective(model_dir)}


if __name__ == "__main__":
    print(json.dumps(main()))
