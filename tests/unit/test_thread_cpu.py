"""`bench.thread_cpu`: each thread's CPU per step, read from /proc, grouped by service and by the
name a thread gives the OS (`shared.runtime.thread_names`)."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.thread_cpu import TICK, _stat, control_ms, last_step, per_step
from shared.runtime.thread_names import name_os_thread

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc and PR_SET_NAME are Linux's")


def test_a_thread_s_name_reaches_the_os_and_its_cpu_is_read_back():
    seen = {}

    def spin() -> None:
        name_os_thread("steadyrl-spin")
        tid = threading.get_native_id()
        before = _stat(Path(f"/proc/{os.getpid()}/task/{tid}/stat"))
        deadline = time.thread_time() + 0.3
        while time.thread_time() < deadline:  # 0.3 s of this thread's own CPU, however busy the machine
            pass
        seen["before"], seen["after"] = before, _stat(Path(f"/proc/{os.getpid()}/task/{tid}/stat"))

    thread = threading.Thread(target=spin, name="a-python-name")
    thread.start()
    thread.join()
    assert seen["after"][1] == "steadyrl-spin"  # the OS name, not "python"
    spent = (seen["after"][2] - seen["before"][2]) / TICK
    assert 0.25 <= spent <= 0.5


def test_cpu_per_step_by_service_and_thread_name():
    before = {("trainer", 10): ("main", 100), ("trainer", 11): ("asyncio_0", 50), ("redis", 20): ("main", 7)}
    after = {
        ("trainer", 10): ("main", 100 + 2 * TICK // 10),  # 0.2 s over 10 steps: 20 ms a step
        ("trainer", 11): ("asyncio_0", 50 + TICK),
        ("trainer", 12): ("asyncio_0", TICK // 2),  # born in between: counted from zero, summed by name
        ("redis", 20): ("main", 7 + TICK // 20),
        ("orchestrator", 30): ("main", 0),  # no CPU in the window: not listed
    }
    threads = per_step(before, after, 10)
    assert threads == {"redis": {"main": 5.0}, "trainer": {"asyncio_0": 150.0, "main": 20.0}}
    assert control_ms(threads) == {
        "inference.main": 0.0,
        "trainer.main": 20.0,
        "orchestrator.*": 0.0,
        "redis.*": 5.0,
        "total": 25.0,
    }


def test_the_last_step_of_a_metrics_file_being_written(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    assert last_step(metrics) == 0  # none yet
    metrics.write_text('{"step": 1, "step_seconds": 0.1}\n{"event": "x"}\n{"step": 2, "step_sec')
    assert last_step(metrics) == 1  # the line being written is not read
