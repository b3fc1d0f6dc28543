"""A two-node trainer on loopback: two torchrun launchers (`steadyrl trainer-node`) meeting at
weight-sync's rendezvous (the `steadyrl` backend: no launcher opens a port), one rank each over
gloo, FSDP across the nodes. One node's launcher is SIGKILLed mid-run; the job restarts it, the
surviving launcher restarts its rank (torchrun --max-restarts) and the two meet again in the next
round: the run resumes from the checkpoint. Then node b's rank is frozen (SIGSTOP): node a's rank
times out in a collective (trainer.parallel.collective_timeout_seconds), and both launchers
restart their ranks (b's frozen one killed by its launcher) — every rollout is trained once."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from redis.asyncio import Redis

from shared.runstore.ledger import Ledger
from tests.helpers import publish
from tests.integration.test_collective_rendezvous import weightsync_process
from tests.integration.test_trainer import TRAINER_ENV, recorded_rollouts

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


TOKEN = "multinode-test-token"


@pytest.fixture
def weightsync(tmp_path):
    with weightsync_process(tmp_path, TOKEN, unsigned_weights="true") as (_, address):
        yield address


def test_two_torchrun_nodes_survive_a_node_kill_and_a_frozen_rank(
    tmp_path, tiny_model_dir, redis_server, run_id, weightsync
):
    rollouts = recorded_rollouts(tiny_model_dir, 36, seed=89)  # 9 steps of 4 prompts
    out = tmp_path / "trainer"
    env = {
        **os.environ,
        "STEADYRL_TOKEN": TOKEN,
        **TRAINER_ENV,
        "STEADYRL_TRAINER_MODEL_PATH": str(tiny_model_dir),
        "STEADYRL_TRAINER_OUT_DIR": str(out),
        "STEADYRL_TRAINER_REDIS_URL": redis_server.url,
        "STEADYRL_TRAINER_RUN_ID": run_id,
        "STEADYRL_TRAINER_MAX_STEPS": "9",
        "STEADYRL_LOG_LEVEL": "INFO",
        "STEADYRL_TRAINER_PARALLEL__COLLECTIVE_TIMEOUT_SECONDS": "15",
        "OMP_NUM_THREADS": "1",
    }
    node = [
        sys.executable,
        "-m",
        "steadyrl.cli",
        "trainer-node",
        str(ROOT / "configs" / "tiny-arith.toml"),
        "--set",
        "trainer.parallel.nodes=2",
        "--set",
        f"trainer.parallel.rdzv_endpoint={weightsync}",
        "--set",
        "trainer.parallel.mode=fsdp",
        "--set",
        "trainer.checkpoint.every=2",
    ]
    metrics = out / "metrics.jsonl"

    def steps() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def start(name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(node, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    async def main():
        redis = Redis.from_url(redis_server.url)
        await publish(redis, run_id, rollouts[: 12 * 4])  # 3 steps first: the kill falls inside the run
        nodes = {"a": start("a"), "b": start("b")}
        deadline = time.monotonic() + 240
        while steps() < 3:  # step 2 checkpointed, step 3 not: the kill costs step 3, trained again
            assert time.monotonic() < deadline and all(p.poll() is None for p in nodes.values()), (
                tmp_path / "a.log"
            ).read_text()[-3000:]
            await asyncio.sleep(0.1)
        killed_at = steps()
        listening = {n: listeners(p.pid) for n, p in nodes.items()}  # the launchers themselves: none
        os.killpg(nodes["b"].pid, signal.SIGKILL)  # node b's launcher and its rank
        nodes["b"].wait()
        await asyncio.sleep(2.0)
        nodes["b"] = start("b")  # the job restarts the lost node
        await publish(redis, run_id, rollouts[12 * 4 : 24 * 4])
        while steps() < 6:  # step 6 checkpointed (checkpoint_every 2)
            assert time.monotonic() < deadline + 120 and all(p.poll() is None for p in nodes.values())
            await asyncio.sleep(0.1)
        [rank_b] = children(nodes["b"].pid)
        os.kill(rank_b, signal.SIGSTOP)  # node b's rank frozen, its launcher alive
        await publish(redis, run_id, rollouts[24 * 4 :])
        codes = {name: await asyncio.to_thread(p.wait, 300) for name, p in nodes.items()}
        ledger = await Ledger(redis, run_id).trained()
        await redis.aclose()
        return killed_at, codes, ledger, listening

    try:
        killed_at, codes, ledger, listening = asyncio.run(asyncio.wait_for(main(), 480))
    finally:
        logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("a", "b")}
    assert codes == {"a": 0, "b": 0}, logs["a"][-3000:] + logs["b"][-3000:]
    assert listening == {"a": [], "b": []}  # no rendezvous store port: the rounds live in weight-sync
    both = logs["a"] + logs["b"]
    assert both.count("event=trainer_layout rank=0 world=2") >= 2  # started, and started again after the kill
    assert "event=resumed checkpoint=step-00000002" in both and "parallel=fsdp" in both and killed_at == 3
    assert len(ledger) == len(set(ledger)) == len(rollouts)  # every rollout trained once
    state = json.loads((out / "checkpoints" / "step-00000009" / "state.json").read_text())
    assert state["step"] == 9 and len(state["consumed"]) == len(rollouts)
    lines = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert lines == list(range(1, 10)), lines  # one line per step, the lost ones cut and trained again
    # the freeze: node a's rank timed out in a collective (15 s), the ranks started a third time and
    # resumed from step 4 or 6 (step 6's async save needs the frozen rank to complete)
    assert both.count("event=trainer_layout rank=0 world=2") >= 3
    assert re.search(r"Timed out waiting 15000ms for (send|recv) operation", logs["a"] + logs["b"])
    assert re.search(r"event=resumed checkpoint=step-0000000[46]", both)
    print(f"node b killed after step {killed_at}; rank starts: {both.count('event=trainer_layout rank=0')}")


def listeners(pid: int) -> list:
    """The ports a launcher listens on (torchrun's own process, not its ranks)."""
    return [c.laddr for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"]


def children(pid: int) -> list[int]:
    """A launcher's ranks: its child processes running the trainer."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in found if b"services.trainer" in Path(f"/proc/{c}/cmdline").read_bytes()]
