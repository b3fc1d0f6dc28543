"""The replicas' idle share: a replica's idle clock (no task generating), and the trainer's per-step
share from the cumulative idle and uptime seconds the heartbeats report."""

import pytest

from services.inference import idle_clock
from services.inference.idle_clock import IdleClock
from services.trainer.replica_idle import ReplicaIdle


def test_the_idle_clock_counts_only_the_time_no_task_generates(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(idle_clock.time, "monotonic", lambda: now[0])
    clock = IdleClock()
    now[0] = 102.0  # 2 s idle
    with clock.busy():
        now[0] = 103.0
        with clock.busy():  # two tasks at once: busy once
            now[0] = 105.0
        assert clock.idle_seconds == 2.0
        now[0] = 106.0
    now[0] = 106.5
    assert clock.idle_seconds == 2.5 and clock.uptime_seconds == 6.5 and clock.active == 0


def test_the_share_per_step_is_over_the_interval_since_the_last_heartbeat():
    shares = ReplicaIdle(redis=None, key="k")
    assert shares.update("r0", 3.0, 4.0) == 0.75  # first seen: since it started
    shares.shares["r0"] = 0.6  # its last share (planted unlike idle / uptime, the fallback of 0.75)
    assert shares.update("r0", 3.0, 4.0) == 0.6  # no heartbeat since: its last share, unchanged
    assert shares.update("r0", 3.5, 6.0) == pytest.approx(0.25)  # 0.5 s idle of the last 2 s
    assert shares.update("r0", 0.2, 1.0) == pytest.approx(0.2)  # restarted: since it started again
    assert shares.update("r0", 0.2, 2.0) == 0.0
