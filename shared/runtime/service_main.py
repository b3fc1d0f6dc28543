"""What every service shares: the entry point (settings from the environment, logging, a serve()
that stops cleanly on SIGTERM / SIGINT) and the loop supervision of serve().

A loop that dies is never silent: `run_loops` logs why, turns the gRPC health NOT_SERVING, stops
the other loops and raises `LoopDied`, so the process exits non-zero and its supervisor
(`steadyrl run`, Kubernetes, compose) restarts it. Health turns NOT_SERVING before any server
stops, on a clean stop too.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass

from shared.runtime.exit_codes import ExitCode
from shared.runtime.logs import setup_logging
from shared.runtime.moved_settings import moved_in_env, moved_message
from shared.runtime.thread_names import libc_prctl

log = logging.getLogger("steadyrl.service")


class LoopDied(RuntimeError):
    """A service loop ended by itself (an error, or a return it must never make)."""


def parent_death_signal(sig: int):
    """A function that makes the calling process receive `sig` when its parent dies (Linux:
    PR_SET_PDEATHSIG; None elsewhere), resolved now so that calling it does nothing but the call:
    fit for `subprocess.Popen(preexec_fn=...)` between fork and exec, from the thread that lives
    as long as the parent (the signal comes when the forking thread ends)."""
    if sys.platform != "linux":
        return None
    prctl = libc_prctl()
    return lambda: prctl(1, sig)  # PR_SET_PDEATHSIG


def die_with_parent() -> None:
    """A rank torchrun started dies when torchrun does, so a killed launcher never leaves ranks
    behind that keep consuming the run's work (`steadyrl run` has torchrun itself, and every
    service, stopped when it dies: `parent_death_signal`)."""
    arm = parent_death_signal(signal.SIGKILL) if "LOCAL_RANK" in os.environ else None
    if arm is None:
        return
    arm()
    if os.getppid() == 1:  # the parent died before the call
        os._exit(ExitCode.FAILED)


def run_service(name: str, settings_cls: type, server_module: str, settings: object | None = None) -> None:
    """Run `server_module.serve` with `settings` (resolved by the caller: `steadyrl serve` reads a
    recipe), else `settings_cls()` from the STEADYRL_<SERVICE>_* variables, until a signal. A
    STEADYRL_RECIPE this entry point cannot read is refused (exit code 2), never ignored."""
    die_with_parent()
    setup_logging(name)
    if settings is None:
        if os.environ.get("STEADYRL_RECIPE", "").strip():
            log.error(
                "event=settings_refused service=%s reason=STEADYRL_RECIPE is read by `python -m steadyrl.cli "
                "serve %s`, not by `python -m services.%s`",
                name,
                name,
                name,
            )
            sys.exit(ExitCode.REFUSED)
        moved = moved_in_env(name, os.environ)
        if moved:  # before pydantic reads them: an old `parallel = "fsdp"` would only fail to parse as a section
            log.error("event=settings_refused service=%s reason=%s", name, moved_message(name, moved))
            sys.exit(ExitCode.REFUSED)
        settings = settings_cls()

    async def run() -> None:
        serve = importlib.import_module(server_module).serve
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop=stop)

    code = ExitCode.OK
    try:
        asyncio.run(run())
    except LoopDied as exc:
        log.error("event=service_exit service=%s reason=%s", name, exc)
        code = ExitCode.FAILED
    # the service is done and exiting: a stop asked for now (SIGTERM, a supervisor that saw it
    # finish) must not turn a clean exit into a kill mid-teardown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "LOCAL_RANK" in os.environ:  # a torchrun rank: leave the group, skip C++ teardown (exit_rank)
        from shared.runtime.distributed import exit_rank

        exit_rank(code)
    sys.exit(code)


@dataclass(frozen=True)
class Serving:
    port: int  # the gRPC port bound
    metrics_port: int  # the /metrics port bound (0: none)
    health: object  # the gRPC health servicer


@contextlib.asynccontextmanager
async def grpc_service(
    name: str,
    register: Sequence,
    service_names: Sequence[str],
    host: str,
    port: int,
    max_message_bytes: int,
    metrics_port: int | None,
    ready: asyncio.Event | None = None,
    run: str = "",
    **fields: object,
) -> AsyncIterator[Serving]:
    """The skeleton every service shares: its gRPC API (with health, reflection, the token and
    TLS: `shared.rpc.start_server`) and /metrics; `ready` is set once both listen. On the way
    out health turns NOT_SERVING first, then the server stops."""
    from shared.rpc import start_server
    from shared.runtime.metrics import start_metrics_server

    server, bound, health = await start_server(register, service_names, f"{host}:{port}", max_message_bytes)
    try:
        metrics = start_metrics_server(metrics_port, host, run) if metrics_port is not None else 0
        extra = " ".join(f"{k}={v}" for k, v in (({"run": run} if run else {}) | fields).items())
        logging.getLogger(f"steadyrl.{name}").info(
            "event=started service=%s port=%d metrics_port=%d %s", name, bound, metrics, extra
        )
        if ready is not None:
            ready.set()
        yield Serving(bound, metrics, health)
    finally:
        await not_serving(health)
        await server.stop(grace=1.0)


async def not_serving(health) -> None:
    """Every service name of this server NOT_SERVING from now on (before it stops)."""
    if health is not None:
        await health.enter_graceful_shutdown()


def settle_heap() -> None:
    """What start-up built (modules, the model, the tokenizer) lives as long as the process: moved
    out of the collector's reach, so a full collection no longer scans millions of objects (one
    paused a replica 100-290 ms every second or two, every thread waiting on the GIL)."""
    gc.collect()
    gc.freeze()


async def run_loops(
    loops: dict[str, Coroutine],
    stop: asyncio.Event,
    health=None,
    finishing: frozenset[str] = frozenset(),
    grace: float = 30.0,
) -> None:
    """Run a service's loops until `stop` is set. A loop named in `finishing` may return: the
    service's work is done, and it stops cleanly. Any other end of a loop (an exception, or a
    return before `stop`) is logged with why and raises LoopDied once the others are stopped."""
    settle_heap()
    tasks = {asyncio.create_task(coro, name=name): name for name, coro in loops.items()}
    stopping = asyncio.create_task(stop.wait())
    died: str | None = None
    try:
        done, _ = await asyncio.wait({*tasks, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is stopping:
                continue
            name = tasks[task]
            error = None if task.cancelled() else task.exception()
            if error is None and (name in finishing or stop.is_set()):
                log.info("event=loop_finished loop=%s", name)
                continue
            died = f"loop {name} {'failed: ' + repr(error) if error else 'returned'}"
            log.error("event=loop_died loop=%s error=%r", name, error, exc_info=error)
    finally:
        await not_serving(health)
        stopping.cancel()
        for task in tasks:
            task.cancel()
        ended, stuck = await asyncio.wait(tasks, timeout=grace) if tasks else (set(), set())
        for task in ended:
            if not task.cancelled() and task.exception() is not None and died is None:
                log.warning("event=loop_error_on_stop loop=%s error=%r", tasks[task], task.exception())
        for task in stuck:  # a loop that ignores its cancellation: say so, do not wait forever
            log.error("event=loop_stuck loop=%s", tasks[task])
    if died is not None:
        raise LoopDied(died)


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def finish_despite_cancellation(work) -> None:
    """Run `work` (bounded by its own timeouts) to its end even if this task is cancelled meanwhile
    — the service's stop cancels the loop while it hands its leases back — then re-raise the
    cancellation, never swallowing it."""
    done = asyncio.ensure_future(work)
    cancelled = False
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled = True
    done.result()
    if cancelled:
        raise asyncio.CancelledError
