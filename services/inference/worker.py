"""The rollout loop of a replica: lease tasks → check → generate G samples each → score → publish.

Leases are renewed while a batch generates; a task whose generation fails is handed back (it is
retried, the attempt counts). Publishing and ending the lease are one atomic step in Redis
(`WorkQueue.complete`), refused when the lease was lost, so a slow replica never duplicates work.
A task that can never be served (undecodable, invalid, too long for the engine, an unknown
reward, another run's) goes to the dead-letter stream with its reason; a task waiting for a
policy version waits at most `version_wait_seconds`, then goes back with the reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import defaultdict, deque

import redis.exceptions
from prometheus_client import Counter, Gauge, Histogram

from services.inference.tasks import BadTask, Checked, LeaseRenewal, check_task
from shared.engines import Engine, Sample, Sampling
from shared.engines.rollouts import encode_samples
from shared.models import decode_completions
from shared.queues import Lease, WorkQueue, now_ms
from shared.rollout import RolloutTimings
from shared.tasks import RewardRunner

log = logging.getLogger("steadyrl.inference.worker")
# every batch runs on this one thread: torch's OpenMP keeps one thread team per calling thread, and
# the default executor's changing threads each woke a team of their own (measured: −10–20% tokens/s)
ENGINE_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")

TOKENS = Counter("steadyrl_inference_generated_tokens_total", "Completion tokens generated", ["replica"])
TOKENS_PER_SECOND = Gauge("steadyrl_inference_tokens_per_second", "Completion tokens/s of the last batch", ["replica"])
BATCH_SIZE = Histogram("steadyrl_inference_batch_sequences", "Sequences per generated batch", ["replica"],
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
PUBLISHED = Counter("steadyrl_inference_rollouts_published_total", "Rollouts published to the stream", ["replica"])
LEASES_LOST = Counter("steadyrl_inference_leases_lost_total", "Tasks finished after their lease was taken away",
                      ["replica"])
RETRIED = Counter("steadyrl_inference_tasks_retried_total", "Leased tasks that were on a retry", ["replica"])
ENGINE_ERRORS = Counter("steadyrl_inference_engine_errors_total", "Batches the engine failed on", ["replica"])
TASK_ERRORS = Counter("steadyrl_inference_task_errors_total", "Tasks that could not be scored or encoded",
                      ["replica"])
BAD_TASKS = Counter("steadyrl_inference_tasks_dead_lettered_total", "Tasks given up as unservable", ["reason"])
VERSION_WAITS = Counter("steadyrl_inference_version_wait_expired_total",
                        "Tasks handed back after waiting too long for their policy version", ["replica"])
REWARD_FAILURES = Counter("steadyrl_inference_reward_failures_total", "Rewards scored 0 because they failed",
                          ["reward", "reason"])
QUEUE_ERRORS = Counter("steadyrl_inference_queue_errors_total", "Redis errors of the rollout loop", ["replica"])


class RolloutWorker:
    def __init__(self, engine: Engine, tokenizer, queue: WorkQueue, replica_id: str, lease_seconds: float,
                 tasks_per_batch: int, idle_poll_seconds: float, return_traces: bool,
                 rewards: RewardRunner | None = None, version_wait_seconds: float = 120.0) -> None:
        self.engine, self.tokenizer, self.queue = engine, tokenizer, queue
        self.replica_id, self.lease_seconds = replica_id, lease_seconds
        self.tasks_per_batch, self.idle_poll_seconds = tasks_per_batch, idle_poll_seconds
        self.return_traces = return_traces and engine.capabilities.routing_trace
        self.rewards = rewards or RewardRunner()
        self.version_wait_seconds = version_wait_seconds
        self.published = 0
        self.tokens_per_second = 0.0
        self.generating = 0  # batches with the engine (running or queued)
        self._delay = 0.1  # backoff while Redis is unreachable

    async def run(self, stop: asyncio.Event) -> None:
        """Lease → generate → publish, keeping the engine busy: the next batch is leased while the
        current one generates and queued on the engine thread behind it, so the engine goes from
        one batch to the next without waiting for this loop; a batch is published once the one
        queued behind it is with the engine."""
        inflight: deque[tuple[asyncio.Task, set[str], LeaseRenewal]] = deque()  # (generating, held, heartbeat)
        publishing: asyncio.Task | None = None
        try:
            while not stop.is_set():
                leases = await self._lease(stop)
                if leases is None:  # Redis unreachable: backed off already
                    continue
                if leases:
                    held = {lease.task_id for lease in leases}
                    heartbeat = LeaseRenewal(self.queue, self.replica_id, self.lease_seconds, held)
                    RETRIED.labels(self.replica_id).inc(sum(1 for lease in leases if lease.attempt > 0))
                    inflight.append((asyncio.create_task(self._generate(leases, held, stop)), held, heartbeat))
                    await asyncio.sleep(0)  # its job reaches the engine thread's queue
                if inflight and (len(inflight) > 1 or not leases):
                    generating, held, heartbeat = inflight.popleft()
                    publishing = await self._start_publishing(publishing, (await generating, held, heartbeat))
                elif not leases:
                    if publishing is not None:
                        await publishing
                        publishing = None
                    else:
                        await _sleep_or_stop(stop, self.idle_poll_seconds)
        finally:
            while inflight:  # generations already with the engine: published, or handed back
                generating, held, heartbeat = inflight.popleft()
                try:
                    generated = await generating
                except BaseException:  # noqa: BLE001 - cancelled with the loop: the leases go back
                    generated = []
                publishing = await self._start_publishing(publishing, (generated, held, heartbeat))
            if publishing is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await publishing

    @property
    def busy(self) -> bool:
        return self.generating > 0

    async def _start_publishing(self, previous: asyncio.Task | None, finished: tuple) -> asyncio.Task:
        if previous is not None:
            await previous  # one batch in flight to Redis at a time
        return asyncio.create_task(self._publish(*finished))

    async def _lease(self, stop: asyncio.Event) -> list[Lease] | None:
        """The next batch of leases ([] when the queue is empty); None after a Redis error, once
        backed off."""
        try:
            leases = await self.queue.lease(self.replica_id, self.lease_seconds, self.tasks_per_batch)
            self._delay = 0.1
            return leases
        except redis.exceptions.RedisError as exc:
            QUEUE_ERRORS.labels(self.replica_id).inc()
            log.warning("event=queue_unreachable error=%s retry_in=%.1fs", type(exc).__name__, self._delay)
            await _sleep_or_stop(stop, self._delay)
            self._delay = min(self._delay * 2, 5.0)
            return None

    async def _generate(self, leases: list[Lease], held: set[str], stop: asyncio.Event | None) -> list[tuple]:
        """Check, wait for the version asked for (bounded), then generate every group of tasks
        with the same sampling; a failed group is left out (its leases go back when published)."""
        checked = []
        for lease in leases:
            try:
                checked.append(check_task(lease, self.queue.run_id, self.engine, self.tokenizer, self.rewards))
            except BadTask as exc:
                await self._give_up(lease, exc.code, str(exc), held)
        checked = await self._wait_for_versions(checked, held, stop)
        groups: dict[bytes, list[Checked]] = defaultdict(list)
        for item in checked:
            groups[item.lease.task.sampling.SerializeToString(deterministic=True)].append(item)
        self.generating += 1
        try:
            done = [await self._generate_group(group) for group in groups.values()]
        finally:
            self.generating -= 1
        return [item for item in done if item is not None]

    async def _give_up(self, lease: Lease, code: str, message: str, held: set[str]) -> None:
        BAD_TASKS.labels(code).inc()
        log.warning("event=task_dead_lettered task=%s reason=%s", lease.task_id, message)
        try:
            await self.queue.dead_letter(self.replica_id, lease.task_id, code, message)
            held.discard(lease.task_id)
        except redis.exceptions.RedisError as exc:  # still held: handed back when the batch ends
            QUEUE_ERRORS.labels(self.replica_id).inc()
            log.warning("event=dead_letter_failed task=%s error=%s", lease.task_id, type(exc).__name__)

    async def _wait_for_versions(self, checked: list[Checked], held: set[str],
                                 stop: asyncio.Event | None) -> list[Checked]:
        """Admission asks some tasks for a policy version newer than the one served: wait for it,
        at most `version_wait_seconds`; tasks still waiting then go back with the reason."""
        need = max((c.lease.task.min_policy_version for c in checked), default=0)
        deadline = time.monotonic() + self.version_wait_seconds
        while self.engine.version < need and time.monotonic() < deadline and not (stop and stop.is_set()):
            await asyncio.sleep(0.02)
        ready = [c for c in checked if c.lease.task.min_policy_version <= self.engine.version]
        for c in checked:
            if c.lease.task.min_policy_version > self.engine.version:
                VERSION_WAITS.labels(self.replica_id).inc()
                reason = (f"version_wait: needs policy version {c.lease.task.min_policy_version}, served "
                          f"{self.engine.version} after {self.version_wait_seconds:.0f}s")
                log.warning("event=version_wait_expired task=%s %s", c.lease.task_id, reason)
                with contextlib.suppress(redis.exceptions.RedisError):
                    if await self.queue.fail(self.replica_id, c.lease.task_id, reason):
                        held.discard(c.lease.task_id)
        return ready

    async def _generate_group(self, group: list[Checked]):
        leased_ms = now_ms()
        prompts = [c.prompt for c in group for _ in range(c.lease.task.group_size)]
        try:
            samples, seconds, encoded = await asyncio.get_running_loop().run_in_executor(
                ENGINE_THREAD, self._generate_and_encode, group, prompts, group[0].sampling, leased_ms)
        except Exception as exc:  # noqa: BLE001 - any engine failure hands the tasks back
            ENGINE_ERRORS.labels(self.replica_id).inc()
            log.exception("event=generation_failed tasks=%s error=%s", [c.lease.task_id for c in group], exc)
            return None
        tokens = sum(len(s.token_ids) for s in samples)
        TOKENS.labels(self.replica_id).inc(tokens)
        BATCH_SIZE.labels(self.replica_id).observe(len(samples))
        self.tokens_per_second = tokens / max(seconds, 1e-9)
        TOKENS_PER_SECOND.labels(self.replica_id).set(self.tokens_per_second)
        return encoded

    def _generate_and_encode(self, group: list[Checked], prompts: list[list[int]], sampling: Sampling,
                             leased_ms: int) -> tuple[list[Sample], float, list[tuple[Lease, list[bytes]]]]:
        """On the engine thread: generate, then score and encode each task's rollouts. Right after
        its batch this costs the engine ~1.5 ms of a ~40 ms batch (tiny model, 2 cores); on the
        event loop during the next batch it slowed that batch by ~20%, the threads taking turns
        on the GIL between torch ops."""
        started_ms, started = now_ms(), time.perf_counter()
        samples: list[Sample] = self.engine.generate(prompts, sampling, self.return_traces)
        seconds = time.perf_counter() - started
        timings = RolloutTimings(leased_ms, started_ms, now_ms(), seconds)
        encoded, position = [], 0
        for item in group:
            mine = samples[position : position + item.lease.task.group_size]
            position += len(mine)
            payloads = self._encode_task(item.lease, mine, timings)
            if payloads is not None:
                encoded.append((item.lease, payloads))
        return samples, seconds, encoded

    async def _publish(self, generated: list[list[tuple[Lease, list[bytes]]]], held: set[str],
                       heartbeat: LeaseRenewal) -> None:
        """Publish each batch's encoded rollouts (one Redis round trip); whatever is still held at
        the end (failed generation, bad task, Redis error) is handed back to the queue."""
        try:
            ready = [item for encoded in generated for item in encoded]
            evals = {lease.task_id for lease, _ in ready if lease.task.is_eval}
            accepted = await self.queue.complete_many(
                self.replica_id, [(lease.task_id, payloads) for lease, payloads in ready], evals)
            for (lease, payloads), ok in zip(ready, accepted, strict=True):
                if ok:
                    PUBLISHED.labels(self.replica_id).inc(len(payloads))
                    self.published += len(payloads)
                else:
                    LEASES_LOST.labels(self.replica_id).inc()
                    log.warning("event=lease_lost task=%s attempt=%d", lease.task_id, lease.attempt)
                held.discard(lease.task_id)
        except redis.exceptions.RedisError as exc:  # leases left behind expire and are retried
            QUEUE_ERRORS.labels(self.replica_id).inc()
            log.warning("event=publish_failed error=%s", type(exc).__name__)
        finally:
            left = sorted(held)
            await heartbeat.stop()  # never renews again, whatever Redis did to it
            for task_id in left:
                with contextlib.suppress(redis.exceptions.RedisError):
                    await self.queue.fail(self.replica_id, task_id, "handed back: generation or publish failed")

    def _encode_task(self, lease: Lease, samples: list[Sample], timings: RolloutTimings) -> list[bytes] | None:
        task = lease.task
        try:
            texts = decode_completions(self.tokenizer, [s.token_ids for s in samples])
            scores = self.rewards.score(task.task_name, texts, task.answer)
            for s in scores:
                if s.reason:
                    REWARD_FAILURES.labels(task.task_name, s.reason.split(":")[0]).inc()
                    log.warning("event=reward_failed task=%s reward=%s reason=%s", lease.task_id, task.task_name,
                                s.reason)
            if not task.run_id:
                task.run_id = self.queue.run_id
            return encode_samples(task, samples, [s.value for s in scores], self.replica_id, self.engine.name,
                                  timings)
        except Exception as exc:  # noqa: BLE001 - a task that cannot be encoded is handed back
            TASK_ERRORS.labels(self.replica_id).inc()
            log.warning("event=task_failed task=%s error=%s", lease.task_id, exc)
            return None


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
