"""The rollout loop of a replica: lease tasks → check → generate G samples each → score → send, without batch
barriers.

A task's G requests enter the engine once it is leased and checked; its rollouts are sent once they are done. Up to
`tasks.max_inflight` tasks stay with the engine (`tasks.batching = "barrier"`: the old behaviour, for comparison).
Sending and ending the lease are one atomic step (`WorkQueue.complete_many`), so a slow replica never duplicates
work. Unservable tasks go to the dead-letter stream with a reason; multi-turn tasks play their G trajectories
(`services.inference.trajectories`).

Details: docs/internals/inference.md"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import redis.exceptions

from services.inference.agents import Endpoint
from services.inference.config import InferenceSettings
from services.inference.finishing import Finishing
from services.inference.idle_clock import IdleClock
from services.inference.judge import JudgeScoring
from services.inference.leased_work import MAX_GROUP_SIZE, Checked, LeaseRenewal, Unservable, check_lease
from services.inference.metrics import (
    BAD_TASKS,
    ENGINE_ERRORS,
    INFLIGHT,
    JUDGE_FAILURES,
    RETRIED,
    REWARD_FAILURES,
    REWARDS_EXCLUDED,
    RUNNING,
    TASK_ERRORS,
    TEACHER_FAILURES,
    TOKENS,
    TOKENS_PER_SECOND,
    VERSION_WAITS,
    TokenRate,
)
from services.inference.rollout_sender import LEASES_LOST, QUEUE_ERRORS, RolloutSender
from services.inference.scoring import Scoring
from services.inference.teacher import TeacherScoring
from services.inference.trajectories import play_group
from shared.engines import Engine, Sample
from shared.engines.base import gathered
from shared.envs.trajectory import TrajectoryError
from shared.models import decode_completions
from shared.rollouts.record import RolloutTimings
from shared.rollouts.samples import encode_samples, scored_problem
from shared.rpc.pool_client import PoolError
from shared.runstore.queues import Lease, WorkQueue, now_ms
from shared.runtime.service_main import finish_despite_cancellation, sleep_or_stop
from shared.tasks import RewardRunner
from shared.tasks.reward_contract import Row
from shared.tasks.shaping import overlong_penalty

log = logging.getLogger("steadyrl.inference.worker")


def free_places(max_inflight: int, sizes: list[int], widest: int) -> int:
    """Tasks of `widest` samples that fit beside tasks of `sizes` samples when `max_inflight` such
    tasks may run at once (a smaller task takes its share of a place, rounded up in total). Pure."""
    return max_inflight - math.ceil(sum(sizes) / widest)


def place_size(group_size: int) -> int:
    """The samples a leased task is counted for before it is checked: its G, within [1,
    MAX_GROUP_SIZE] (a task claiming more is dead-lettered once checked). Pure."""
    return min(max(1, group_size), MAX_GROUP_SIZE)


class EngineDead(RuntimeError):
    """The engine can serve nothing any more: the replica must stop (its supervisor restarts it)."""


class TooFewScored(ValueError):
    """A training group whose rewards scored too few of its completions: dropped, not trained."""


class RolloutWorker:
    """A replica's rollout loop (`run`), on the replica's settings: its `replica_id`, `return_routing_traces` and
    `tasks` ([inference.tasks]: leasing, batching, version waits, the scored rewards a group needs)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        queue: WorkQueue,
        settings: InferenceSettings,
        rewards: RewardRunner | None = None,
        *,
        teacher: TeacherScoring | None = None,
        judging: JudgeScoring | None = None,
        endpoint: Endpoint | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.queue = queue
        self.replica_id = settings.replica_id
        self.leasing = settings.tasks
        self.return_traces = settings.return_routing_traces and engine.capabilities.routing_trace
        self.rewards = rewards or RewardRunner()
        self.teacher = teacher  # on-policy distillation: a teacher pool scores each group before it is sent
        self.judging = judging or JudgeScoring(None, {}, self.rewards)  # judge:/reward_model: rewards
        self.endpoint = endpoint  # the agent endpoint agent and verifiers tasks play through
        self.declared = frozenset(settings.plugins)  # the plug-ins a task may name: the run's own
        self.rate = TokenRate()
        self.idle = IdleClock()  # no task generating: the replica's idle share
        self.held: set[str] = set()  # leases this replica renews
        self.inflight: dict[str, asyncio.Task] = {}
        self.sizes: dict[str, int] = {}  # each task in flight: its G
        self.widest = settings.group_size  # the run's G: `max_inflight` counts tasks of this G
        self.task_ended = asyncio.Event()  # set as a task leaves `inflight`: room to lease again
        self.new_version = asyncio.Event()  # set (and replaced) as a version lands in the engine
        self.finishing = Finishing()  # tasks back from the engine, not yet handed to the sender
        self.scoring = Scoring()  # rewards and encoding on the scoring thread, a loop turn's groups together
        self.sender = RolloutSender(queue, self.replica_id, self.held, self._requeue, self.finishing.settled)
        self._delay = 0.1  # backoff while Redis is unreachable
        self._reclaim = False  # a lease call failed: it may have leased tasks all the same

    async def version_changed(self) -> None:
        """A version landed in the engine (or failed to): every task waiting for one looks again."""
        landed, self.new_version = self.new_version, asyncio.Event()
        landed.set()  # every waiter resumes in the same turn of the loop: their groups enter the engine together

    @property
    def sent(self) -> int:
        return self.sender.sent

    @property
    def busy(self) -> bool:
        return bool(self.inflight)

    @property
    def tokens_per_second(self) -> float:  # completion tokens/s over the last 10 s
        return self.rate.per_second

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the engine full: lease while there is room, serve every task on its own, send
        whatever is done in one Redis call at a time."""
        renewal = LeaseRenewal(self.queue, self.replica_id, self.leasing.lease_seconds, self.held)
        sending = asyncio.create_task(self.sender.loop())
        try:
            await self._pools_ready(stop)
            while not stop.is_set():
                self._check_engine()
                room = self._room()
                leases = await self._lease(stop, min(room, self.leasing.per_batch)) if room else []
                if leases is None:  # Redis unreachable: backed off already
                    continue
                for lease in leases:
                    self.held.add(lease.task_id)
                    self.sizes[lease.task_id] = place_size(lease.task.group_size)
                    self.inflight[lease.task_id] = asyncio.create_task(self._serve(lease))
                RETRIED.labels(self.replica_id).inc(sum(1 for lease in leases if lease.attempt > 0))
                INFLIGHT.labels(self.replica_id).set(len(self.inflight))
                RUNNING.labels(self.replica_id).set(getattr(self.engine, "running", 0))
                TOKENS_PER_SECOND.labels(self.replica_id).set(self.rate.per_second)
                if leases and len(leases) == min(room, self.leasing.per_batch) and self._room():
                    continue  # the queue may hold more: lease again at once
                await self._wait(stop, poll=bool(self._room()))
                await self.finishing.settled()  # the places a burst of tasks frees, leased in one call
        finally:
            await finish_despite_cancellation(self._shutdown(sending, renewal))

    async def _pools_ready(self, stop: asyncio.Event) -> None:
        """Before the first lease, a replica of each pool this replica calls answers (bounded by the
        pool's `ready_seconds`; past it PoolError ends the replica): a task leased while a pool's
        model still loads would fail its attempts and die."""
        clients = [c for c in (self.teacher and self.teacher.client, self.judging.client) if c is not None]
        if not clients:
            return
        ready = asyncio.ensure_future(asyncio.gather(*(c.wait_ready() for c in clients)))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not ready.done():
            ready.cancel()
            await asyncio.gather(ready, return_exceptions=True)
            return
        ready.result()

    def _room(self) -> int:
        """Tasks to lease now. `max_inflight` counts tasks of the run's G; a smaller one takes its
        share (an eval prompt, one greedy sample, 1/G of a place), a wider one more than one:
        an eval round fills the engine's batch as a training step does, instead of running 1/G of
        it at a time (docs/internals/inference.md#eval-rounds)."""
        if self.leasing.batching == "barrier":
            return 0 if self.inflight else self.leasing.per_batch
        sizes = [self.sizes.get(task_id, self.widest) for task_id in self.inflight]
        return free_places(self.leasing.max_inflight, sizes, self.widest)

    def _check_engine(self) -> None:
        if (error := getattr(self.engine, "error", None)) is not None:
            raise EngineDead(f"the {self.engine.name} engine died: {error}")

    async def _wait(self, stop: asyncio.Event, poll: bool) -> None:
        """Until a task finishes (there is room again) or, with room, the next poll of the queue.
        One event, not a wait on every task in flight: the loop turns once per finished task."""
        ended = asyncio.ensure_future(self.task_ended.wait())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait(
                {stopping, ended},
                return_when=asyncio.FIRST_COMPLETED,
                timeout=self.leasing.idle_poll_seconds if poll or not self.inflight else None,
            )
        finally:
            stopping.cancel()
            ended.cancel()
        self.task_ended.clear()

    async def _lease(self, stop: asyncio.Event, count: int) -> list[Lease] | None:
        """Up to `count` leases ([] when the queue is empty); None after a Redis error, once
        backed off."""
        try:
            leases = []
            if self._reclaim:  # a lease call's reply was lost: Redis may have leased us tasks we do not know of
                leases = await self.queue.reclaim(self.replica_id, self.held, self.leasing.lease_seconds)
                self._reclaim = False
                # none: the tasks it leased expired meanwhile and went back to the queue (the frozen
                # replica's case): nothing of theirs is held here, nothing is sent late
                log.warning("event=leases_reclaimed tasks=%s", ",".join(lease.task_id for lease in leases) or "none")
            if count > len(leases):
                leases += await self.queue.lease(self.replica_id, self.leasing.lease_seconds, count - len(leases))
            self._delay = 0.1
            return leases
        except redis.exceptions.RedisError as exc:
            self._reclaim = True
            QUEUE_ERRORS.labels(self.replica_id).inc()
            log.warning("event=queue_unreachable error=%s retry_in=%.1fs", type(exc).__name__, self._delay)
            await sleep_or_stop(stop, self._delay)
            self._delay = min(self._delay * 2, 5.0)
            return None

    async def _serve(self, lease: Lease) -> None:
        """One task: check, wait for its version (bounded), generate its G samples, score and
        encode them, and queue them for sending; on any failure the lease goes back."""
        try:
            try:
                checked = check_lease(
                    lease, self.queue.run_id, self.engine, self.tokenizer, self.rewards, self.judging, self.declared
                )
            except Unservable as exc:
                await self._dead_letter(lease, exc.code, exc.message)
                return
            if not await self._version_ready(checked):
                return
            with self.idle.busy():
                payloads = await (self._play if lease.task.environment else self._sample)(checked, now_ms())
            if payloads is not None and self.teacher is not None and not lease.task.is_eval:
                payloads = await self._teacher_scored(lease, payloads)
            if payloads is not None:  # else dead-lettered or requeued already
                self.sender.add(lease, payloads)
        finally:
            self.inflight.pop(lease.task_id, None)
            self.sizes.pop(lease.task_id, None)
            self.finishing.end(lease.task_id)
            self.task_ended.set()

    async def _generate(self, checked: Checked, leased_ms: int) -> tuple[list[Sample] | None, RolloutTimings | None]:
        task = checked.lease.task
        started_ms = now_ms()
        started = time.perf_counter()
        futures = []
        try:
            futures = self.engine.start_many([checked.prompt] * task.group_size, checked.sampling, self.return_traces)
            samples = await gathered(futures)
        except asyncio.CancelledError:
            for f in futures:
                f.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - any engine failure hands the task back
            for f in futures:
                f.cancel()
            ENGINE_ERRORS.labels(self.replica_id).inc()
            log.warning("event=generation_failed task=%s error=%s", checked.lease.task_id, exc)
            return None, None
        tokens = sum(len(s.token_ids) for s in samples)
        TOKENS.labels(self.replica_id).inc(tokens)
        self.rate.add(tokens)
        return samples, RolloutTimings(leased_ms, started_ms, now_ms(), time.perf_counter() - started)

    async def _sample(self, checked: Checked, leased_ms: int) -> list[bytes] | None:
        """A single-turn task's G rollouts, scored; None once dead-lettered or requeued."""
        samples, timings = await self._generate(checked, leased_ms)
        self.finishing.begin(checked.lease.task_id)
        if samples is None:
            await self._requeue(checked.lease.task_id, "generation failed")
            return None
        judged = None
        if self.judging.judges(checked.lease.task.task_name):
            judged = await self._judged(checked.lease, samples)
            if judged is None:
                return None
        try:
            payloads = await self.scoring.run(self._encode_group, checked.lease, samples, timings, judged)
        except TooFewScored as exc:
            await self._dead_letter(checked.lease, "reward_failed", str(exc))
            return None
        if payloads is None:
            await self._requeue(checked.lease.task_id, "the task's rollouts could not be scored or encoded")
        return payloads

    async def _play(self, checked: Checked, leased_ms: int) -> list[bytes] | None:
        """A multi-turn task's G rollouts; None once dead-lettered (an environment failed) or
        requeued (the engine failed)."""
        lease = checked.lease
        try:
            return await play_group(
                self.engine,
                self.tokenizer,
                checked,
                self.return_traces,
                self.replica_id,
                self.queue.run_id,
                leased_ms,
                self.rate,
                self.leasing.reward_min_scored,
                self.endpoint,
            )
        except TrajectoryError as exc:
            await self._dead_letter(lease, exc.code, exc.message)
        except Exception as exc:  # noqa: BLE001 - any engine failure requeues the task
            ENGINE_ERRORS.labels(self.replica_id).inc()
            log.warning("event=generation_failed task=%s error=%s", lease.task_id, exc)
            await self._requeue(lease.task_id, "generation failed")
        return None

    async def _teacher_scored(self, lease: Lease, payloads: list[bytes]) -> list[bytes] | None:
        """The group with the teacher's logprobs; None once requeued (the pool failed every attempt:
        the queue retries the task and, past its attempts, dead-letters it with this reason)."""
        try:
            return await self.teacher.attach(payloads)
        except PoolError as exc:
            TEACHER_FAILURES.labels(self.replica_id).inc()
            log.warning("event=teacher_failed task=%s reason=%s", lease.task_id, exc.reason[:300])
            await self._requeue(lease.task_id, f"teacher: {exc.reason}")
            return None

    async def _judged(self, lease: Lease, samples: list[Sample]) -> tuple[list, list[float] | None] | None:
        """The judge pool's rewards of the group (and the rule rewards they are compared with); None
        once requeued (the pool failed every attempt: the queue retries the task and, past its
        attempts, dead-letters it with this reason)."""
        task = lease.task
        prompt, *texts = decode_completions(self.tokenizer, [task.prompt_token_ids, *(s.token_ids for s in samples)])
        try:
            return await self.judging.score(task.task_name, prompt, texts, task.answer)
        except PoolError as exc:
            JUDGE_FAILURES.labels(self.replica_id).inc()
            log.warning("event=judge_failed task=%s reason=%s", lease.task_id, exc.reason[:300])
            await self._requeue(lease.task_id, f"judge: {exc.reason}")
            return None

    async def _dead_letter(self, lease: Lease, code: str, message: str) -> None:
        """Send a task that can never be served to the dead-letter stream with its reason (requeued
        instead when Redis does not take it)."""
        BAD_TASKS.labels(code).inc()
        log.warning("event=task_dead_lettered task=%s code=%s reason=%s", lease.task_id, code, message)
        try:
            await self.queue.dead_letter(self.replica_id, lease.task_id, code, message)
            self.held.discard(lease.task_id)
        except redis.exceptions.RedisError as exc:  # still held: requeued below
            QUEUE_ERRORS.labels(self.replica_id).inc()
            log.warning("event=dead_letter_failed task=%s error=%s", lease.task_id, type(exc).__name__)
            await self._requeue(lease.task_id, f"dead letter failed: {message}")

    async def _requeue(self, task_id: str, reason: str) -> None:
        """Stop renewing the task's lease and give the task back to the queue, this attempt failed with
        the reason: the queue retries it (if Redis is down, its lease expires and it is retried all the
        same). Redis refuses when the lease ran out meanwhile (it was retried elsewhere), counted and
        logged as a lost lease like a refused send."""
        self.held.discard(task_id)
        with contextlib.suppress(redis.exceptions.RedisError):
            if not await self.queue.fail(self.replica_id, task_id, f"handed back: {reason}"):
                LEASES_LOST.labels(self.replica_id).inc()
                log.warning("event=lease_lost task=%s on=hand_back", task_id)

    async def _version_ready(self, checked: Checked) -> bool:
        """Admission may ask for a policy version newer than the one served: wait for it, at most
        `tasks.version_wait_seconds`; a task still waiting then goes back with the reason."""
        need = checked.lease.task.min_policy_version
        deadline = time.monotonic() + self.leasing.version_wait_seconds
        while self.engine.version < need and time.monotonic() < deadline:
            # woken as a version lands (`version_changed`); the period covers any other way in
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.new_version.wait(), min(0.5, max(deadline - time.monotonic(), 0)))
        if self.engine.version >= need:
            return True
        VERSION_WAITS.labels(self.replica_id).inc()
        reason = (
            f"version_wait: needs policy version {need}, served {self.engine.version} after "
            f"{self.leasing.version_wait_seconds:.0f}s"
        )
        log.warning("event=version_wait_expired task=%s %s", checked.lease.task_id, reason)
        await self._requeue(checked.lease.task_id, reason)
        return False

    async def _shutdown(self, sending: asyncio.Task, renewal: LeaseRenewal) -> None:
        """Stopping: tasks still generating go back to the queue, finished ones are sent."""
        serving = list(self.inflight.values())
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError, redis.exceptions.RedisError):
            await asyncio.wait_for(self.sender.send(), 10)
        left = sorted(self.held)
        await renewal.stop()  # never renews again, whatever Redis did to it
        for task_id in left:
            await self._requeue(task_id, "the replica stopped")

    def _encode_group(
        self, lease: Lease, samples: list[Sample], timings: RolloutTimings, judged: tuple | None = None
    ) -> list[bytes] | None:
        """The group's rollouts, scored by the task's reward (`judged`: the judge pool's rewards and
        the rule rewards they are compared with), encoded; None when that fails."""
        task = lease.task
        try:
            if judged is None:
                texts = decode_completions(self.tokenizer, [s.token_ids for s in samples])
                row = Row.from_json(task.reward_row)  # checked with the lease
                scores, reference = self.rewards.score(task.task_name, texts, task.answer, row), None
            else:
                scores, reference = judged
            for s in scores:
                for reason in s.failures or ((s.reason,) if s.reason else ()):
                    REWARD_FAILURES.labels(task.task_name, reason.split(":")[0]).inc()
                if s.reason:
                    REWARDS_EXCLUDED.labels(task.task_name).inc()
                    log.warning(
                        "event=reward_failed task=%s reward=%s reason=%s calls=%d",
                        lease.task_id,
                        task.task_name,
                        s.reason,
                        max(len(s.failures), 1),
                    )
            problem = "" if task.is_eval else scored_problem([s.reason for s in scores], self.leasing.reward_min_scored)
            if problem:
                raise TooFewScored(problem)
            if not task.run_id:
                task.run_id = self.queue.run_id
            shaping = task.overlong  # checked with the lease (check_lease)
            return encode_samples(
                task,
                samples,
                [
                    s.value
                    + overlong_penalty(
                        len(sample.token_ids), task.sampling.max_new_tokens, shaping.buffer_tokens, shaping.penalty
                    )
                    for s, sample in zip(scores, samples, strict=True)
                ],
                self.replica_id,
                self.engine.name,
                timings,
                [s.reason for s in scores],
                reference,
            )
        except TooFewScored:
            raise
        except Exception as exc:  # noqa: BLE001 - a task that cannot be encoded is requeued
            TASK_ERRORS.labels(self.replica_id).inc()
            log.warning("event=task_failed task=%s error=%s", lease.task_id, exc)
            return None
