"""Calls into a pool of model-signal replicas (a teacher or a judge) with bounded waits: each attempt
has a deadline, a failed or slow replica is left for the next one (round robin), and after
`attempts` tries the call fails with the reason of the last — the caller hands its task back, so a
pool that is down, slow or answering garbage delays work and never loses it.

Details: docs/guides/pools.md"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence

import grpc
from prometheus_client import Counter

log = logging.getLogger("steadyrl.pools")
ATTEMPTS_FAILED = Counter(
    "steadyrl_inference_pool_attempts_failed_total",
    "Calls to a teacher or judge replica that failed (an error, a timeout, or a reply refused as unusable), by reason",
    ["pool", "reason"],
)
# what another replica, or the same one later, may answer differently
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)


class PoolError(RuntimeError):
    """A pool call that failed every attempt (or was refused as invalid): `reason` says why."""

    def __init__(self, pool: str, reason: str) -> None:
        super().__init__(f"{pool} pool: {reason}")
        self.pool = pool
        self.reason = reason


class PoolClient:
    """One channel per replica address, kept open; `call` runs an RPC on them in turn."""

    def __init__(
        self,
        pool: str,
        addresses: Sequence[str],
        stub: Callable[[grpc.aio.Channel], object],
        timeout_seconds: float,
        attempts: int,
        backoff_seconds: float = 0.2,
        ready_seconds: float = 600.0,
        channel: Callable[[str], grpc.aio.Channel] | None = None,
    ) -> None:
        if not addresses:
            raise ValueError(f"the {pool} pool has no replica address")
        from shared.rpc import channel_options
        from shared.rpc.auth import channel as open_channel

        self.pool = pool
        self.addresses = list(addresses)
        self.timeout_seconds = timeout_seconds
        self.attempts = attempts
        self.backoff_seconds = backoff_seconds
        self.ready_seconds = ready_seconds
        # an address that names several replicas (a deployment's headless Service, compose's scaled
        # service) spreads its calls over all of them, and a failed attempt's retry finds the next
        options = [*channel_options(), ("grpc.lb_policy_name", "round_robin")]
        make = channel or (lambda address: open_channel(address, options=options))
        self.channels = [make(a) for a in self.addresses]
        self.stubs = [stub(c) for c in self.channels]
        self._next = itertools.cycle(range(len(self.stubs)))

    async def call(
        self,
        method: str,
        request,
        check: Callable[[object], str] | None = None,
        prefer: Callable[[object], str] | None = None,
    ) -> object:
        """`method` of a replica's stub on `request`, at most `attempts` tries of `timeout_seconds`
        each. `check(reply)` returns a reason when the reply is unusable ('' when it is good): a
        failed attempt. `prefer(reply)` returns a reason when another replica may answer better (a
        verdict it could not read): a failed attempt too, but the first such reply is kept, and
        taken when no attempt does better (the last attempt's is taken as it is). Reasons start
        with a short code and a colon (the counter's label). Raises PoolError with the last reason."""
        reason = "no attempt"
        usable = None  # the first reply only `prefer` found fault with
        first = next(self._next)  # calls start on the replicas in turn; a call's retries go on from its own start,
        for attempt in range(self.attempts):  # so concurrent calls never send one call twice to a dead replica
            index = (first + attempt) % len(self.stubs)
            address = self.addresses[index]
            try:
                reply = await getattr(self.stubs[index], method)(request, timeout=self.timeout_seconds)
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                reason = f"{address}: {code} {exc.details() or ''}".strip()
                ATTEMPTS_FAILED.labels(self.pool, code.lower()).inc()
                if exc.code() not in RETRYABLE:
                    raise PoolError(self.pool, reason) from None
            else:
                problem = check(reply) if check else ""
                if not problem and prefer is not None and attempt + 1 < self.attempts:
                    problem = prefer(reply)
                    usable = reply if problem and usable is None else usable
                if not problem:
                    return reply
                code = problem.split(":", 1)[0] if ":" in problem else "unusable"
                ATTEMPTS_FAILED.labels(self.pool, code if code.isidentifier() else "unusable").inc()
                reason = f"{address}: {problem}"
            log.warning("event=pool_call_failed pool=%s attempt=%d reason=%s", self.pool, attempt + 1, reason[:300])
            if attempt + 1 < self.attempts:
                await asyncio.sleep(self.backoff_seconds * 2**attempt)
        if usable is not None:  # no replica did better than a reply with unread verdicts: take it
            return usable
        raise PoolError(self.pool, f"{self.attempts} attempts failed, the last: {reason}")

    async def wait_ready(self, poll_seconds: float = 30.0) -> float:
        """Until a replica of the pool accepts a connection (a pool replica listens once its model is
        loaded), at most `ready_seconds`, so a rollout replica started beside its pools leases no task
        the pool would fail. Returns the seconds waited; raises PoolError past the bound."""
        seconds = self.ready_seconds
        clock = asyncio.get_running_loop().time
        started = clock()
        while True:
            waits = [asyncio.ensure_future(c.channel_ready()) for c in self.channels]
            left = max(min(poll_seconds, started + seconds - clock()), 0)
            done, pending = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            for wait in pending:
                wait.cancel()
            waited = clock() - started
            if done:
                return waited
            if waited >= seconds:
                raise PoolError(self.pool, f"no replica of {','.join(self.addresses)} answered within {seconds:g}s")
            log.info(
                "event=waiting_for_pool pool=%s addresses=%s waited_s=%.0f", self.pool, ",".join(self.addresses), waited
            )

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.channels), return_exceptions=True)
