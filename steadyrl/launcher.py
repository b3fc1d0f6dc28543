"""`steadyrl run`: the whole system as local processes on loopback, one run, one report.

    recipe checked → redis-server and every service started, healthy → run started through the
    control plane → progress shown while the supervisor restarts what exits → every process
    stopped → summary, plots and the final model written

The pieces: steadyrl/processes.py (the processes), supervisor.py (restarts), progress.py (what
is shown), summary.py (what is left, and the exit codes).
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from steadyrl.processes import Launch, Service
from steadyrl.progress import PROGRESS, watch
from steadyrl.recipe import Recipe, resolve_model
from steadyrl.service_settings import check, settle_auto_dtype, settle_local_transport
from steadyrl.summary import finish, render_plots
from steadyrl.supervisor import Supervisor


@contextlib.contextmanager
def interruptible():
    """SIGINT and SIGTERM raise KeyboardInterrupt while a run is on, so a job scheduler's SIGTERM
    or `timeout` stops every service like Ctrl-C does (and a SIGINT ignored by the shell that
    started us in the background still works). The previous handlers come back afterwards."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(config: Recipe, out: Path, progress: str = "auto") -> dict:
    """Run `config` to the end; returns the summary (also written to out/summary.json). The recipe
    is checked first: a bad value fails here, before any process starts. `progress`: "rich" (a
    live table), "plain" (a log line every ~5% of the steps and at each eval: for logs, nohup,
    Slurm, a pod), "none", or "auto" (rich on a terminal, else plain)."""
    if progress not in PROGRESS:
        raise ValueError(f"progress must be one of {PROGRESS}, got {progress!r}")
    check(config)  # placement included: a recipe that needs more GPUs than exist never starts
    with interruptible():
        return _run(config, out, progress)


def start_run(launch: Launch, supervisor: Supervisor, timeout: float = 120.0) -> None:
    """POST /v1/run/start; again while the control plane cannot reach Redis (503: restarting, or
    the supervisor restarting it), at most `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        supervisor.check()
        try:
            launch.api("POST", "/v1/run/start")
            return
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 409:  # the directory holds a run of this id already
                state = launch.api("GET", "/v1/run")["state"]
                if state == "running":  # its launcher stopped: the services pick it up where it was
                    return
                raise RuntimeError(
                    f"{launch.out} holds a run of {launch.config.run_id} that is {state} (its Redis data and "
                    "checkpoints): give --out a new directory, or leave --out out for runs/<id>-<time>"
                ) from None
            if exc.response.status_code != 503 or time.monotonic() > deadline:
                raise
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


STARTED = re.compile(r"event=started service=\S+ port=\d+ metrics_port=(\d+)")


def metrics_port(service: Service, wait: float = 5.0) -> int:
    """The /metrics port `service` bound, as the last `event=started` line of its log says (`steadyrl run`
    lets each service draw a free one); 0 when it serves none, or has not said within `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        text = service.log.read_text(errors="replace") if service.log and service.log.exists() else ""
        found = STARTED.findall(text)
        if found or time.monotonic() > deadline:
            return int(found[-1]) if found else 0
        time.sleep(0.1)


def control_plane(launch: Launch) -> str:
    """The orchestrator's HTTP API: the control plane, its /docs, and its /metrics."""
    from shared.rpc.tls import tls_from_env

    return f"{'https' if tls_from_env() else 'http'}://127.0.0.1:{launch.http_port}"


def healthy_line(launch: Launch, service: Service) -> str:
    """`NAME healthy: gRPC HOST:PORT, metrics URL`, shown as each service turns healthy."""
    line = f"  {service.name:<14} healthy: gRPC 127.0.0.1:{service.grpc_port}"
    if service.name == "orchestrator":  # its /metrics is on the control plane's port
        return f"{line}, metrics {control_plane(launch)}/metrics"
    port = metrics_port(service)
    return f"{line}, metrics http://127.0.0.1:{port}/metrics" if port else line


def control_plane_line(launch: Launch) -> str:
    """Where to watch and steer the run, and the token it asks for; shown once every service is healthy."""
    token = launch.out / "token"
    return f"  {'control plane':<14} {control_plane(launch)}  /v1/run, /docs (bearer token: {token})"


def _run(config: Recipe, out: Path, progress: str) -> dict:
    import logging

    from rich.console import Console

    logging.getLogger("httpx").setLevel(logging.WARNING)
    console = Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(config)
    config = settle_local_transport(settle_auto_dtype(config, model_path))
    (out / "config.resolved.toml").write_text(config.as_toml())
    console.print(f"[bold]steadyrl run[/] {config.run_id} → {out}")
    # soft_wrap on the lines below: a path or an address is never broken across lines, whatever the width
    for note in config.notes:
        console.print(f"  {note}", markup=False, soft_wrap=True)
    launch = Launch(config, out, model_path)
    started = time.time()
    summary: dict = {"run_id": config.run_id, "out": str(out), "model": model_path}
    supervisor = Supervisor(launch, lambda line: console.print(line, markup=False))
    drawing, plots = ThreadPoolExecutor(1, thread_name_prefix="plots"), None
    try:
        launch.start_all(lambda s: console.print(healthy_line(launch, s), markup=False, soft_wrap=True))
        console.print(control_plane_line(launch), markup=False, soft_wrap=True)
        if launch.placed_over:  # a deployment's values: on this host `steadyrl run` places them
            placed = ", ".join(launch.placed_over)
            console.print(
                f"  placed by steadyrl run, not as the recipe sets them: {placed}", markup=False, soft_wrap=True
            )
        for folder in launch.swept:
            console.print(
                f"  removed the version files a stopped run of {config.run_id} left: {folder}",
                markup=False,
                soft_wrap=True,
            )
        launch.write_pids()
        start_run(launch, supervisor)
        status = watch(launch, supervisor, console, progress)
        if status.get("state") == "finished":  # its records are final: drawn while the services stop
            plots = drawing.submit(render_plots, out)
        summary["final_status"] = status
        summary["outcome"] = status.get("state", "unknown")
        if "failure" in status:  # a stop rule failed it (services/orchestrator/stop_rules.py)
            summary["error"] = f"{status['failure']['rule']}: {status['failure']['reason']}"
            console.print(f"run failed: {summary['error']}", markup=False, style="red")
    except KeyboardInterrupt:
        summary["outcome"] = "interrupted"
        console.print("[yellow]interrupted: stopping every service[/]")
    except (RuntimeError, TimeoutError) as exc:  # a process that keeps failing (GaveUp), or never became healthy
        summary.update(outcome="failed", error=str(exc))
        console.print(f"run failed: {exc}", markup=False, style="red")
    except Exception as exc:  # noqa: BLE001 - whatever it is, the run is stopped and the summary written
        summary.update(outcome="failed", error=f"{type(exc).__name__}: {exc}")
        console.print(f"run failed: {type(exc).__name__}: {exc}", markup=False, style="red")
    finally:
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:  # a second signal must not cut the teardown short and leave services behind
            launch.stop_all()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    summary["wall_seconds"] = round(time.time() - started, 1)
    finish(launch, summary, plots)
    drawing.shutdown()
    return summary
