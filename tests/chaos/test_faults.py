"""Faults in a whole-system run on loopback (real processes, killed by the pids this test started):
after each, the run completes and the ledger holds: every submitted task trained, dropped as stale
or dead-lettered; no rollout trained twice; every replica applied versions in increasing order."""

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from shared.runstore.keys import RunKeys
from shared.runstore.ledger import Ledger
from steadyrl.processes import Launch
from steadyrl.recipe import load_recipe
from tests.helpers import running, wait_until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
B = 4
G = 8


def service(launch: Launch, name: str):
    return next(s for s in launch.services if s.name == name)


def kill_and_restart(launch: Launch, name: str) -> None:
    target = service(launch, name)
    os.kill(target.process.pid, signal.SIGKILL)
    target.process.wait(10)
    launch.start(target)
    try:
        launch.wait_healthy(target)
    except RuntimeError:
        # a restarted trainer can catch up on the rollouts queued meanwhile and finish the run before
        # the first health probe; a clean exit is fine, the ledger below checks the run
        if target.process.returncode != 0:
            raise


def weightsync_restart(launch: Launch) -> None:
    target = service(launch, "weightsync")
    target.process.send_signal(signal.SIGTERM)
    target.process.wait(20)
    time.sleep(1.0)  # replicas keep serving their last version meanwhile
    launch.start(target)
    launch.wait_healthy(target)


def redis_restart(launch: Launch) -> None:
    launch.redis.stop()  # SIGTERM: the AOF is flushed; a SIGKILL could lose up to its 1 s window
    time.sleep(1.0)
    launch.redis.start()


def redis_sigkill(launch: Launch) -> None:
    launch.redis.stop(kill=True)  # the kernel still holds what redis wrote: a process crash loses ~nothing
    time.sleep(1.0)
    launch.redis.start()


def redis_host_crash(launch: Launch) -> None:
    """A host crash under appendfsync everysec: the disk keeps the AOF as it was up to a second ago."""
    aof = launch.redis.directory / "appendonly.aof"
    on_disk = aof.read_bytes()
    time.sleep(1.0)  # the run goes on; these writes are acknowledged but never reach the disk
    launch.redis.stop(kill=True)
    assert aof.stat().st_size > len(on_disk)  # something is really lost
    aof.write_bytes(on_disk)
    launch.redis.start()


def freeze(process, seconds: float) -> None:
    """A process hung but alive (a long fsync, a paused VM): SIGSTOP, then SIGCONT."""
    os.kill(process.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(process.pid, signal.SIGCONT)


def freeze_mid_step(launch: Launch, seconds: float) -> None:
    """Freeze the weight-sync service while the trainer is inside a step (started, not ended): the
    step's push then meets the frozen service."""
    trainer = service(launch, "trainer")
    deadline = time.monotonic() + 60
    while True:
        text = trainer.log.read_text()
        if text.count("event=step_started ") > text.count("event=step step="):
            return freeze(service(launch, "weightsync").process, seconds)
        assert time.monotonic() < deadline, "the trainer never stepped"
        time.sleep(0.001)


def leases_held(launch: Launch, replica_id: str) -> list[str]:
    """The tasks Redis says `replica_id` holds right now."""

    async def read():
        redis = Redis.from_url(launch.redis.url)
        try:
            owners = await redis.hgetall(RunKeys(launch.config.run_id).owners)
            return [t.decode() for t, owner in owners.items() if owner.decode() == replica_id]
        finally:
            await redis.aclose()

    return asyncio.run(read())


def stop_while_holding(launch: Launch, name: str, replica_id: str) -> None:
    """SIGSTOP the replica at a moment it holds leases (stopped first, then looked at: the tasks
    it holds then cannot finish under it)."""
    target = service(launch, name).process
    deadline = time.monotonic() + 120
    while True:
        os.kill(target.pid, signal.SIGSTOP)
        if leases_held(launch, replica_id):
            time.sleep(0.5)  # a completion it sent just before the stop still reaches Redis
            if leases_held(launch, replica_id):
                return
        os.kill(target.pid, signal.SIGCONT)
        assert time.monotonic() < deadline, f"{name} never held a lease"
        time.sleep(0.01)


def stall_replica(launch: Launch) -> None:
    stop_while_holding(launch, "inference-0", "replica-0")  # a frozen process: its leases run out
    time.sleep(8.0)
    target = service(launch, "inference-0")
    os.kill(target.process.pid, signal.SIGCONT)
    # thawed, it first catches up on the versions announced meanwhile, then publishes or hands back
    # what it held: wait for that refusal here, as the run may finish on the other replica before it
    deadline = time.monotonic() + 60
    while not re.search(MECHANISMS["inference_sigstop"]["inference-0"], log := target.log.read_text()):
        tail = "\n".join(log.splitlines()[-15:])
        assert time.monotonic() < deadline, f"the thawed replica never returned its lost leases:\n{tail}"
        time.sleep(0.2)


def kill_replica(launch: Launch) -> None:
    stop_while_holding(launch, "inference-0", "replica-0")
    target = service(launch, "inference-0")
    os.kill(target.process.pid, signal.SIGKILL)  # not restarted: the other replica takes over
    target.process.wait(10)
    target.process = None  # gone for good: the launcher's watchdog must not mind


FAULTS = {
    "inference_sigkill": kill_replica,
    "trainer_sigkill": lambda launch: kill_and_restart(launch, "trainer"),
    "weightsync_restart": weightsync_restart,
    "redis_restart": redis_restart,
    "redis_sigkill": redis_sigkill,
    "redis_host_crash": redis_host_crash,
    "orchestrator_sigkill": lambda launch: kill_and_restart(launch, "orchestrator"),
    "inference_sigstop": stall_replica,
    "redis_sigstop": lambda launch: freeze(launch.redis.process, 20.0),
    "weightsync_sigstop": lambda launch: freeze_mid_step(launch, 6.0),
}


# what each fault must be seen to exercise (log file → pattern), beside the end state every fault shares
MECHANISMS = {
    "inference_sigkill": {"orchestrator": r"event=leases_expired requeued=[1-9]"},  # its leases ran out
    "inference_sigstop": {
        "orchestrator": r"event=leases_expired requeued=[1-9]",  # ...and its late result
        # was refused, or, when the freeze cut the lease call's reply, the reclaim finds them gone
        "inference-0": r"event=lease_lost task=\S+|event=leases_reclaimed tasks=none",
    },
    "trainer_sigkill": {"trainer": r"event=resumed checkpoint=step-\d+ step=\d+"},  # back from its checkpoint
    # the replicas' watch streams broke, they watched the new service and received versions from it again
    "weightsync_restart": {
        f"inference-{i}": r"event=weights_stream_lost error=UNAVAILABLE(?s:.*)event=weights_applied" for i in (0, 1)
    },
    "redis_restart": {"trainer": r"event=redis_restarted claimed=\d+ ledger_restored=\d+"},
    "redis_sigkill": {"trainer": r"event=redis_restarted claimed=\d+ ledger_restored=\d+"},
    "redis_host_crash": {"trainer": r"event=redis_restarted claimed=\d+ ledger_restored=\d+"},
    "orchestrator_sigkill": {"orchestrator": r"event=resumed run=\S+ state=running"},
    "redis_sigstop": {"trainer": r"event=redis_unreachable error=TimeoutError", "orchestrator": r"event=tick_failed"},
    # the push waited through the 6 s freeze (bounded by publish_timeout_seconds) instead of failing the step
    "weightsync_sigstop": {"trainer": r"(?m)event=step .* seconds=(?:[5-9]|[1-9][0-9])\.\d+$"},
}


# slow, each covered by another test: Redis restarted or SIGKILLed by redis_host_crash (the same recovery
# from its harshest form) and test_run_faults' supervised redis-server; Redis frozen by test_run_faults'
# 20 s freeze; the orchestrator SIGKILLed by test_run.py's orchestrator restart; a replica SIGKILLed by
# the multi-turn case below and tests/integration/test_inference.py; the trainer SIGKILLed (and restarted
# by `steadyrl run` itself) by test_supervisor.py and test_run_faults' kill as a checkpoint lands
SLOW_FAULTS = {
    "redis_restart",
    "redis_sigkill",
    "redis_sigstop",
    "orchestrator_sigkill",
    "inference_sigkill",
    "trainer_sigkill",
    "weightsync_restart",  # the default suite restarts weight-sync under a vLLM run (tests/chaos/test_vllm_faults.py)
}


@pytest.mark.parametrize(
    "fault", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FAULTS else f for f in sorted(FAULTS)]
)
def test_the_run_survives(fault, tmp_path, tiny_model_dir):
    config = load_recipe(
        ROOT / "configs" / "tiny-arith.toml",
        [
            f"run.steps={STEPS}",
            f"run.batch_prompts={B}",
            f"run.group_size={G}",
            "run.replicas=2",
            "orchestrator.evals.every=0",
            "trainer.checkpoint.every=1",
            "inference.tasks.lease_seconds=3",
            "inference.tasks.per_batch=2",
        ],
    )
    with running(config, tmp_path, tiny_model_dir) as launch:
        FAULTS[fault](launch)
        wait_until(launch, lambda status: status["state"] == "finished")
        ledger = asyncio.run(read_ledger(launch.redis.url, config.run_id))
    assert_ledger(tmp_path, ledger, STEPS, B, G)
    for name, pattern in MECHANISMS[fault].items():  # the mechanism the fault exercises, seen at work
        assert re.search(pattern, (tmp_path / "logs" / f"{name}.log").read_text()), (name, pattern)
    for log in (tmp_path / "logs").glob("inference-*.log"):
        versions = [int(v) for v in re.findall(r"event=weights_applied version=(\d+)", log.read_text())]
        assert versions == sorted(versions) and len(set(versions)) == len(versions), log.name


def assert_ledger(out: Path, ledger, steps: int, b: int, g: int) -> None:
    """Every step trained B whole groups of G, no rollout twice, every submitted task accounted for."""
    trained, dropped, dead, submitted, rollouts_dead = ledger
    assert "future_version" not in rollouts_dead and not rollouts_dead.get("no_lease")
    assert len(trained) == len(set(trained)) == steps * b * g  # the ledger lists each rollout once
    final = sorted((out / "trainer" / "checkpoints").glob("step-*"))[-1]
    state = json.loads((final / "state.json").read_text())
    # every step trains B whole groups of G; a rollout trained twice would leave the union short
    assert state["step"] == steps and len(state["consumed"]) == steps * b * g
    by_task: dict[str, int] = {}
    for rid in trained:
        task = rid.split(":")[0]
        by_task[task] = by_task.get(task, 0) + 1
    assert all(count == g for count in by_task.values())  # whole groups only
    accounted = set(by_task) | {rid.split(":")[0] for rid in dropped} | dead
    assert accounted == {f"train-{i}" for i in range(submitted)}  # every task accounted for


async def read_ledger(url: str, run_id: str):
    redis = Redis.from_url(url)
    ledger = Ledger(redis, run_id)
    keys = RunKeys(run_id)
    trained = await ledger.trained()
    dropped = await ledger.dropped()
    dead = {f[b"task_id"].decode() for _, f in await redis.xrange(keys.dead)}
    submitted = int(await redis.hget(keys.run, "submitted"))
    rollouts_dead = await ledger.rollouts_dead_counts()
    await redis.aclose()
    return trained, dropped, dead, submitted, rollouts_dead


def leased_policy_evals(launch: Launch, run_id: str) -> list[str]:
    """π's eval tasks leased right now."""

    async def read():
        redis = Redis.from_url(launch.redis.url)
        try:
            return [t.decode() for t in await redis.zrange(RunKeys(run_id).leases, 0, -1) if t.startswith(b"evalpi-")]
        finally:
            await redis.aclose()

    return asyncio.run(read())


def eval_leases(launch: Launch, run_id: str) -> dict[str, str]:
    """task id → the lease (`replica|attempt`) that published it, for every entry of the evals stream."""

    async def read():
        redis = Redis.from_url(launch.redis.url)
        try:
            return {f[b"task"].decode(): f[b"lease"].decode() for _, f in await redis.xrange(RunKeys(run_id).evals)}
        finally:
            await redis.aclose()

    return asyncio.run(read())


# slow: a frozen replica's leases run out and its late result is refused in inference_sigstop, and a
# policy_eval pool's tasks stay in their pool through lease expiry in tests/integration/test_queues.py
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
def test_a_frozen_or_killed_policy_eval_replica_loses_no_round(fault, tmp_path, tiny_model_dir):
    """orchestrator.evals.policy: the replica of the policy_eval pool frozen (8 s, past its 3 s leases)
    or SIGKILLed and restarted while it holds π's tasks of a round: the leases expire, the tasks go
    back to that pool's list (no rollout replica takes them), and every round of μ and of π is
    written once, whole."""
    config = load_recipe(
        ROOT / "configs" / "tiny-arith.toml",
        [
            f"run.steps={STEPS}",
            f"run.batch_prompts={B}",
            f"run.group_size={G}",
            "orchestrator.evals.every=10",
            "orchestrator.evals.size=40",
            "orchestrator.evals.policy=true",
            "inference.tasks.lease_seconds=3",
        ],
    )
    with running(config, tmp_path, tiny_model_dir) as launch:
        target = service(launch, "inference-policy").process
        deadline = time.monotonic() + 120
        while True:  # stopped first, then looked at: the tasks it holds then cannot finish under it
            os.kill(target.pid, signal.SIGSTOP)
            if leased_policy_evals(launch, config.run_id):
                time.sleep(0.5)  # a completion it sent just before the stop still reaches Redis
                if held := leased_policy_evals(launch, config.run_id):
                    break
            os.kill(target.pid, signal.SIGCONT)
            assert time.monotonic() < deadline, "the policy_eval replica never leased a task"
            time.sleep(0.01)
        if fault == "sigstop":
            time.sleep(8.0)
            os.kill(target.pid, signal.SIGCONT)
        else:
            kill_and_restart(launch, "inference-policy")
        wait_until(launch, lambda status: status["state"] == "finished")
        leases = eval_leases(launch, config.run_id)
    for name in ("eval.jsonl", "policy-eval.jsonl"):
        rounds = [json.loads(line) for line in (tmp_path / "orchestrator" / name).read_text().splitlines()]
        assert [r["step"] for r in rounds] == [0, 10, 20, 30], name
        assert all(r["prompts"] == 40 and "dead" not in r for r in rounds), rounds
    pi = {task: lease for task, lease in leases.items() if task.startswith("evalpi-")}
    assert len(pi) == 4 * 40 and all(lease.startswith("replica-policy|") for lease in pi.values())
    assert not any(lease.startswith("replica-policy|") for task, lease in leases.items() if task not in pi)
    # each task it held was served on a later lease: its first one expired and went back to the pool
    # (after a freeze the replica may finish a task under the new lease, its own again: no lease lost)
    assert all(not pi[task].endswith("|0") for task in held), {task: pi[task] for task in held}


def test_a_multi_turn_run_survives_a_replica_killed_mid_trajectory(tmp_path, calc_model_dir):
    """configs/tiny-tools.toml, a replica SIGKILLed while it holds multi-turn tasks (their trajectories
    between turns or inside one): the leases run out, the tasks go back and are played again from
    their start by the other replica; every step trains whole groups of whole trajectories, none
    twice, and every task is accounted for."""
    steps = 12
    b = 4
    g = 8
    config = load_recipe(
        ROOT / "configs" / "tiny-tools.toml",
        [
            f"run.steps={steps}",
            f"run.batch_prompts={b}",
            f"run.group_size={g}",
            "run.replicas=2",
            "orchestrator.evals.every=0",
            "trainer.checkpoint.every=1",
            "inference.tasks.lease_seconds=3",
            "inference.tasks.per_batch=2",
        ],
    )
    with running(config, tmp_path, calc_model_dir) as launch:
        kill_replica(launch)
        wait_until(launch, lambda status: status["state"] == "finished")
        ledger = asyncio.run(read_ledger(launch.redis.url, config.run_id))
    assert_ledger(tmp_path, ledger, steps, b, g)
    assert re.search(
        MECHANISMS["inference_sigkill"]["orchestrator"], (tmp_path / "logs" / "orchestrator.log").read_text()
    )
    lines = [json.loads(x) for x in (tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, steps + 1))
    assert all(x["turns_mean"] >= 1 and 0 < x["env_tokens_fraction"] < 1 for x in lines)  # trajectories, trained
