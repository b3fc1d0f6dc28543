"""What a replica's rollout loop counts (Prometheus `steadyrl_inference_*`), and its token rate."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import Counter, Gauge, Histogram

TOKENS = Counter("steadyrl_inference_generated_tokens_total", "Completion tokens generated", ["replica"])
TOKENS_PER_SECOND = Gauge("steadyrl_inference_tokens_per_second", "Completion tokens/s over the last 10 s", ["replica"])
INFLIGHT = Gauge("steadyrl_inference_inflight_tasks", "Leased tasks with the engine or being scored", ["replica"])
RUNNING = Gauge("steadyrl_inference_running_sequences", "Sequences the engine is generating", ["replica"])
RETRIED = Counter("steadyrl_inference_tasks_retried_total", "Leased tasks that were on a retry", ["replica"])
ENGINE_ERRORS = Counter("steadyrl_inference_engine_errors_total", "Tasks the engine failed on", ["replica"])
TASK_ERRORS = Counter("steadyrl_inference_task_errors_total", "Tasks that could not be scored or encoded", ["replica"])
BAD_TASKS = Counter("steadyrl_inference_tasks_dead_lettered_total", "Tasks given up as unservable", ["reason"])
VERSION_WAITS = Counter(
    "steadyrl_inference_version_wait_expired_total",
    "Tasks handed back after waiting too long for their policy version",
    ["replica"],
)
POLICY_VERSION = Gauge(
    "steadyrl_inference_policy_version", "Policy version the engine serves (set once it serves)", ["replica", "pool"]
)
SWAP_SECONDS = Histogram(
    "steadyrl_inference_swap_seconds",
    "Generation paused while a version was applied",
    ["replica"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60),
)
REWARD_FAILURES = Counter(
    "steadyrl_inference_reward_failures_total", "Rewards scored 0 because they failed", ["reward", "reason"]
)


class TokenRate:
    """Completion tokens per second over a sliding window (a running total: read after every task)."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self.events = deque()
        self.total = 0

    def add(self, tokens: int) -> None:
        self.events.append((time.monotonic(), tokens))
        self.total += tokens

    @property
    def per_second(self) -> float:
        now = time.monotonic()
        while self.events and now - self.events[0][0] > self.window:
            self.total -= self.events.popleft()[1]
        if not self.events:
            return 0.0
        span = max(now - self.events[0][0], 1.0)
        return self.total / span
