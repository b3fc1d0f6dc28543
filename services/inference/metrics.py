"""What a replica's rollout loop counts (Prometheus `steadyrl_inference_*`), what a teacher or judge
pool replica serves (`steadyrl_pool_*`), and the token rate."""

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
TEACHER_FAILURES = Counter(
    "steadyrl_inference_teacher_failures_total",
    "Groups handed back because the teacher pool failed every attempt to score them",
    ["replica"],
)
JUDGE_FAILURES = Counter(
    "steadyrl_inference_judge_failures_total",
    "Groups handed back because the judge pool failed every attempt to judge them",
    ["replica"],
)
BAD_TASKS = Counter("steadyrl_inference_tasks_dead_lettered_total", "Tasks given up as unservable", ["reason"])
VERSION_WAITS = Counter(
    "steadyrl_inference_version_wait_expired_total",
    "Tasks handed back after waiting too long for their policy version",
    ["replica"],
)
POOL_REQUESTS = Counter(
    "steadyrl_pool_requests_total", "Requests a pool replica (teacher, judge) answered", ["pool", "replica", "method"]
)
POOL_FAILURES = Counter(
    "steadyrl_pool_failures_total",
    "Requests a pool replica refused or failed, by reason",
    ["pool", "replica", "reason"],
)
POOL_TOKENS = Counter("steadyrl_pool_tokens_total", "Tokens a pool replica scored or generated", ["pool", "replica"])
POOL_QUEUE = Gauge(
    "steadyrl_pool_queue_depth", "Requests at a pool replica waiting for or in its engine (KEDA's scaler)", ["pool"]
)
POOL_SECONDS = Histogram(
    "steadyrl_pool_request_seconds",
    "A pool request from arrival to answer, the wait for the engine included",
    ["pool", "replica"],
    buckets=(0.005, 0.02, 0.1, 0.5, 2, 10, 60),
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
    "steadyrl_inference_reward_failures_total",
    "Reward calls that failed (raised, hung, no finite value, a verdict not read), retried ones included",
    ["reward", "reason"],
)
REWARDS_EXCLUDED = Counter(
    "steadyrl_inference_rewards_excluded_total",
    "Completions whose every reward call failed: sent with the reason, left out of the loss",
    ["reward"],
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
