"""`steadyrl run`: the whole system as local processes on loopback, one run, one report.

Starts redis-server (embedded, AOF on, a password made for this run), weight-sync, the trainer,
K inference replicas (and, with orchestrator.policy_eval, one replica of the policy_eval pool) and
the orchestrator on loopback ports (drawn below the ephemeral range and held until each process
starts: steadyrl/ports.py), all at once (those sharing a GPU one after another), waits for every
gRPC health check, starts the run through the control plane, shows progress, and at the end (or
on Ctrl-C) stops every process it started — SIGTERM, then SIGKILL after a grace period — and
writes the run directory.

While the run is on it supervises, as Kubernetes would: a service (or redis-server) that exits
is restarted on the same port after a backoff (run.restart_backoff_seconds, doubled each time),
at most run.max_restarts times per service, each logged; the services resume where they were
(the trainer from its checkpoint and the stream, replicas from the queue), so nothing is lost.
The trainer exiting 0 means it finished its steps and is not restarted.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.redis_server import RedisServer
from steadyrl.placement import placement_of, visible_gpus
from steadyrl.ports import PortReservations
from steadyrl.run_config import RunConfig, check, service_env, validate


@dataclass
class Service:
    name: str
    argv: list[str]  # after `python`: ["-m", "services.trainer"], or torchrun's
    env: dict[str, str]  # STEADYRL_<SERVICE>_* (validated against the service's settings)
    grpc_port: int
    devices: dict[str, str] = field(default_factory=dict)  # CUDA_VISIBLE_DEVICES
    process: subprocess.Popen | None = None
    log: Path | None = None
    restarts: int = 0
    restart_at: float | None = None  # when a restart is due (monotonic), while one is pending
    ports: tuple[int, ...] = ()  # every port it listens on, held by the launcher until it starts


@dataclass
class Launch:
    config: RunConfig
    out: Path
    model_path: str
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    redis_password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    services: list[Service] = field(default_factory=list)
    redis: RedisServer | None = None
    http_port: int = 0
    gpus_available: int | None = None  # None: this machine's (steadyrl.placement.gpu_inventory)
    ports: PortReservations = field(default_factory=PortReservations)

    # --- setup ----------------------------------------------------------------------------------

    def inference_replicas(self) -> int:
        """The replicas this run started, π's (orchestrator.policy_eval) too: the final status waits
        for each to report the last version."""
        return sum(s.name.startswith("inference") for s in self.services)

    def plan(self, redis_url: str) -> None:
        """Every service's command, environment, port and devices (nothing starts here)."""
        c, out = self.config, self.out
        settings = check(c, self.gpus_available)
        placement = placement_of(c, settings, self.gpus_available)
        ws, trainer, master, orch_grpc = (self.ports.take() for _ in range(4))
        self.http_port = self.ports.take()
        common = {"host": "127.0.0.1", "metrics_port": 0}
        shm = {} if "shm_dir" in c.section("weightsync") else {"shm_dir": str(settings["trainer"].shm_dir)}
        self.services.append(Service("weightsync", ["-m", "services.weightsync"], service_env(c, "weightsync", {
            **common, "port": ws, "spill_dir": str(out / "weightsync-spill"), **shm}), ws, placement.visible(()), ports=(ws,)))
        self.services.append(Service("trainer", placement.trainer_argv(master), service_env(c, "trainer", {
            **common, "port": trainer, "model_path": self.model_path, "out_dir": str(out / "trainer"),
            "redis_url": redis_url, "weightsync_address": f"127.0.0.1:{ws}",
            **({} if "publish_dtype" in c.section("trainer") else {"publish_dtype": settings["inference"].dtype}),
        }), trainer, placement.visible(placement.trainer), ports=(trainer, master)))
        policy = {"pool": "policy_eval", "quantization": "none", "quantize_router": False,
                  "quantize_activations": False}  # π: the published weights, unquantised
        for index in range(len(placement.replicas)):
            port, is_policy = self.ports.take(), index == c.replicas
            self.services.append(Service("inference-policy" if is_policy else f"inference-{index}",
                                         ["-m", "services.inference"], service_env(
                c, "inference", {**common, "port": port, "model_path": self.model_path, "redis_url": redis_url,
                                 "replica_id": "replica-policy" if is_policy else f"replica-{index}",
                                 "weightsync_address": f"127.0.0.1:{ws}", "orchestrator_address": f"127.0.0.1:{orch_grpc}",
                                 **(policy if is_policy else {})}),
                port, placement.visible(placement.replicas[index]), ports=(port,)))
        (out / "token").write_text(self.token)
        os.chmod(out / "token", 0o600)
        self.services.append(Service("orchestrator", ["-m", "services.orchestrator"], service_env(c, "orchestrator", {
            "host": "127.0.0.1", "http_port": self.http_port, "grpc_port": orch_grpc, "model_path": self.model_path,
            "out_dir": str(out / "orchestrator"), "redis_url": redis_url, "trainer_address": f"127.0.0.1:{trainer}",
            "token_file": str(out / "token")}), orch_grpc, placement.visible(()), ports=(orch_grpc, self.http_port)))
        for service in self.services:
            validate(service.name.split("-")[0], service.env)

    def add_replica(self, template: Service, replica_id: str) -> Service:
        """One more inference replica like `template`, started now (it joins the running run)."""
        port = self.ports.take()
        env = {**template.env, "STEADYRL_INFERENCE_PORT": str(port), "STEADYRL_INFERENCE_REPLICA_ID": replica_id}
        validate("inference", env)
        service = Service(replica_id, list(template.argv), env, port, dict(template.devices), ports=(port,))
        self.services.append(service)
        self.start(service)
        return service

    def start(self, service: Service) -> None:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        service.log = logs / f"{service.name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEADYRL_")}
        env.update(service.env, **service.devices, STEADYRL_LOG_LEVEL=os.environ.get("STEADYRL_LOG_LEVEL", "INFO"),
                   STEADYRL_TOKEN_FILE=str(self.out / "token"))  # one bearer token for gRPC and HTTP
        self.ports.release(*service.ports)  # bound by this process until now: nothing else could take them
        with service.log.open("ab") as log:
            service.process = subprocess.Popen([sys.executable, *service.argv], env=env, stdout=log,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True)

    def start_redis(self) -> RedisServer:
        """redis-server with AOF on, on a port drawn like the services' (below the ephemeral range)."""
        port = self.ports.take()
        self.ports.release(port)  # redis-server binds it next
        self.redis = RedisServer(self.out / "redis", port=port, appendonly=True, password=self.redis_password).start()
        return self.redis

    def start_all(self, on_healthy=None) -> None:
        """redis-server, then every service at once (a service's start is mostly its imports and
        model load, which overlap), each waited for until healthy in plan order. Each service
        retries its peers until they answer, so none needs another up first; only a service that
        shares a GPU with one started before it waits for that one to be healthy (vLLM sizes its
        KV cache from the GPU memory it finds free: two profiling at once would each count the
        other's)."""
        self.plan(self.start_redis().url)
        pending: list[Service] = []

        def healthy(service: Service) -> None:
            self.wait_healthy(service)
            pending.remove(service)
            if on_healthy is not None:
                on_healthy(service)

        for service, first in zip(self.services, start_after(self.services), strict=True):
            for earlier in [s for s in pending if s.name in first]:
                healthy(earlier)
            self.start(service)
            pending.append(service)
        for service in list(pending):
            healthy(service)

    def wait_healthy(self, service: Service, timeout: float = 600.0) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from shared.rpc.tls import sync_channel

        deadline = time.monotonic() + timeout
        # short reconnect backoff: a channel that met the port closed must not sleep seconds past the bind
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500)]
        with sync_channel(f"127.0.0.1:{service.grpc_port}", options=options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if service.process.poll() is not None:
                    raise RuntimeError(f"{service.name} exited with {service.process.returncode}; see {service.log}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{service.name} not healthy after {timeout:.0f}s; see {service.log}")

    def api(self, method: str, path: str) -> dict:
        import httpx

        from shared.rpc.tls import httpx_options, tls_from_env

        tls = tls_from_env()
        reply = httpx.request(method, f"{'https' if tls else 'http'}://127.0.0.1:{self.http_port}{path}",
                              headers={"Authorization": f"Bearer {self.token}"}, timeout=10, **httpx_options(tls))
        reply.raise_for_status()
        return reply.json()

    # --- supervision ----------------------------------------------------------------------------

    def supervise(self, echo=print) -> None:
        """One look at every process: schedule a restart for one that exited, start those due.
        Raises RuntimeError once a service has used up run.max_restarts."""
        run = self.config.run
        if self.redis is not None and self.redis.process is not None and self.redis.process.poll() is not None:
            echo(f"event=service_exited service=redis-server code={self.redis.process.returncode} restart=now")
            self.redis.start()
            self.write_pids()
        for service in self.services:
            if service.process is None:  # removed on purpose
                continue
            code = service.process.poll()
            if code is None or (service.name == "trainer" and code == 0):
                continue
            if service.restart_at is None:
                if service.restarts >= run.max_restarts:
                    raise RuntimeError(f"{service.name} exited with {code} after {service.restarts} restarts; "
                                       f"see {service.log}")
                delay = run.restart_backoff_seconds * 2 ** service.restarts
                service.restart_at = time.monotonic() + delay
                echo(f"event=service_exited service={service.name} code={code} restart_in={delay:.1f}s "
                     f"restarts={service.restarts}/{run.max_restarts}")
            elif time.monotonic() >= service.restart_at:
                service.restarts += 1
                service.restart_at = None
                self.start(service)
                self.write_pids()
                echo(f"event=service_restarted service={service.name} pid={service.process.pid} "
                     f"restarts={service.restarts}/{run.max_restarts}")

    # --- teardown -------------------------------------------------------------------------------

    def stop_all(self, grace: float = 15.0) -> None:
        running = [s for s in reversed(self.services) if s.process is not None and s.process.poll() is None]
        for service in running:
            _signal_group(service.process, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for service in running:
            try:
                service.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(service.process, signal.SIGKILL)
                service.process.wait()
        self.ports.close()
        if self.redis is not None:
            self.redis.stop()
        trainer = next((s for s in self.services if s.name == "trainer"), None)
        if trainer is not None:  # the shared-memory version files of this run (RAM, not disk)
            shm = Path(trainer.env.get("STEADYRL_TRAINER_SHM_DIR", "/dev/shm/steadyrl")) / self.config.run_id
            shutil.rmtree(shm, ignore_errors=True)

    def pids(self) -> dict[str, int]:
        """Process ids by service name (redis-server included), as they are now."""
        out = {s.name: s.process.pid for s in self.services if s.process is not None}
        if self.redis is not None and self.redis.process is not None:
            out["redis-server"] = self.redis.process.pid
        return out

    def write_pids(self) -> None:
        (self.out / "pids.json").write_text(json.dumps(self.pids()))


def start_after(services: list[Service]) -> list[frozenset[str]]:
    """For each service (in start order), the earlier services that must be healthy before it
    starts: those sharing a GPU with it (run.colocate). Empty on a machine without GPUs."""
    return [frozenset(s.name for s in services[:i] if visible_gpus(s.devices) & visible_gpus(service.devices))
            for i, service in enumerate(services)]


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)  # the service and anything it spawned (vLLM workers)


def resolve_model(config: RunConfig) -> str:
    path = config.model.path
    if path == "tiny":  # cold-started on the run's task (the arith model for a math run)
        from shared.models.tiny import KitTask, init_tiny_model

        orchestrator = config.section("orchestrator")
        if orchestrator.get("task") != "mul_trace":
            return str(init_tiny_model())
        kit = KitTask("mul_trace", **{k: orchestrator[k] for k in ("trace_max_answer_tokens", "trace_alpha")
                                       if k in orchestrator})
        return str(init_tiny_model(task=kit, seed=int(orchestrator.get("task_seed", 0))))
    return path


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


PROGRESS = ("auto", "rich", "plain", "none")


def run(config: RunConfig, out: Path, progress: str = "auto") -> dict:
    """Run `config` to the end; returns the summary (also written to out/summary.json). The recipe
    is checked first: a bad value fails here, before any process starts. `progress`: "rich" (a
    live table), "plain" (a log line every ~5% of the steps and at each eval: for logs, nohup,
    Slurm, a pod), "none", or "auto" (rich on a terminal, else plain)."""
    if progress not in PROGRESS:
        raise ValueError(f"progress must be one of {PROGRESS}, got {progress!r}")
    check(config)  # placement included: a recipe that needs more GPUs than exist never starts
    with interruptible():
        return _run(config, out, progress)


def _run(config: RunConfig, out: Path, progress: str) -> dict:
    import logging

    from rich.console import Console

    logging.getLogger("httpx").setLevel(logging.WARNING)
    console = Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.resolved.toml").write_text(config.as_toml())
    console.print(f"[bold]steadyrl run[/] {config.run_id} → {out}")
    model_path = resolve_model(config)
    launch = Launch(config, out, model_path)
    started = time.time()
    summary: dict = {"run_id": config.run_id, "out": str(out), "model": model_path}
    try:
        launch.start_all(lambda s: console.print(f"  {s.name:<14} healthy on 127.0.0.1:{s.grpc_port}"))
        launch.write_pids()
        launch.api("POST", "/v1/run/start")
        status = watch(launch, console, progress)
        summary["final_status"] = status
        summary["outcome"] = status.get("state", "unknown")
    except KeyboardInterrupt:
        summary["outcome"] = "interrupted"
        console.print("[yellow]interrupted: stopping every service[/]")
    except (RuntimeError, TimeoutError) as exc:  # a service that keeps failing, or never became healthy
        summary.update(outcome="failed", error=str(exc))
        console.print(f"run failed: {exc}", markup=False, style="red")
    finally:
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:  # a second signal must not cut the teardown short and leave services behind
            launch.stop_all()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    summary["wall_seconds"] = round(time.time() - started, 1)
    finish(launch, summary)
    return summary


def progress_rows(status: dict, metrics: list[dict], evals: list[dict], steps: int,
                  elapsed: float, policy_evals: list[dict] = ()) -> list[tuple[str, str]]:
    """What the progress shows, as (name, value) pairs. Pure."""
    last = metrics[-1] if metrics else {}
    step = int(last.get("step", 0))
    eta = elapsed / step * (steps - step) if step and steps else None
    return [
        ("step", f"{step}/{steps or '∞'}"), ("trainer version", str(status.get("trainer_version", 0))),
        ("replica versions", str(status.get("replica_versions", {}))),
        ("reward", f"{last.get('reward_mean', 0):.3f}"), ("mismatch KL (k3)", f"{last.get('mismatch_kl_k3', 0):.2e}"),
        ("staleness max", str(last.get("staleness_max", 0))), ("tokens/s", f"{last.get('tokens_per_s', 0):.0f}"),
        ("eval accuracy", ", ".join(f"v{e['version']}: {e['accuracy']:.3f}" for e in evals[-4:]) or "-"),
        *([("policy eval", ", ".join(f"v{e['version']}: {e['accuracy']:.3f}" for e in policy_evals[-4:]))]
          if policy_evals else []),  # π, the trainer's weights unquantised (orchestrator.policy_eval)
        ("ETA", f"{eta:.0f}s" if eta is not None else "-"),
    ]


def plain_line(rows: list[tuple[str, str]]) -> str:
    """One log line of the progress rows: `step=12/400 trainer_version=12 ...`."""
    return "progress " + " ".join(f"{name.replace(' ', '_').replace('(', '').replace(')', '')}={value.replace(' ', '')}"
                                  for name, value in rows if name != "replica versions")


class _PlainProgress:
    """`progress = "plain"`: a line every `every` steps, at each new eval and at the end."""

    def __init__(self, console, steps: int) -> None:
        self.console, self.every = console, max(1, steps // 20) if steps else 10
        self.next_step, self.evals = 0, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, rows: list[tuple[str, str]], step: int, evals: int, done: bool) -> None:
        if step >= self.next_step or evals > self.evals or done:
            self.console.print(plain_line(rows), markup=False, highlight=False, soft_wrap=True)
            self.next_step = (step // self.every + 1) * self.every
            self.evals = evals


def watch(launch: Launch, console, progress: str) -> dict:
    from rich.live import Live
    from rich.table import Table

    steps = launch.config.steps
    metrics_path = launch.out / "trainer" / "metrics.jsonl"
    begun = time.monotonic()
    if progress == "auto":
        progress = "rich" if console.is_terminal else "plain"

    def render(rows: list[tuple[str, str]], state: str) -> Table:
        table = Table(title=f"{launch.config.run_id}: {state}", show_header=False)
        for name, value in rows:
            table.add_row(name, value)
        return table

    status: dict = {}
    caught_up_wait = 0.0
    replicas = launch.inference_replicas()
    display = (Live(render(progress_rows({}, [], [], steps, 0.0), "?"), console=console, refresh_per_second=2)
               if progress == "rich" else _PlainProgress(console, steps) if progress == "plain" else None)
    with display or contextlib.nullcontext() as live:
        while True:
            launch.supervise(lambda line: console.print(line, markup=False))
            try:
                status = launch.api("GET", "/v1/run")
            except Exception:  # noqa: BLE001 - the control plane may be busy; try again
                time.sleep(0.5)
                continue
            if live is not None:
                metrics, evals = read_jsonl(metrics_path), read_jsonl(launch.out / "orchestrator" / "eval.jsonl")
                rows = progress_rows(status, metrics, evals, steps, time.monotonic() - begun,
                                     read_jsonl(launch.out / "orchestrator" / "policy-eval.jsonl"))
                if progress == "rich":
                    live.update(render(rows, status.get("state", "?")))
                else:
                    live.update(rows, int(metrics[-1].get("step", 0)) if metrics else 0, len(evals),
                                status.get("state") in ("finished", "stopped"))
            if status.get("state") == "finished" and not caught_up(status, replicas):
                caught_up_wait = caught_up_wait or time.monotonic()
                if time.monotonic() - caught_up_wait < 15:  # let every replica report the last version
                    time.sleep(0.5)
                    continue
            if status.get("state") in ("finished", "stopped"):
                return status
            time.sleep(0.5)


def caught_up(status: dict, replicas: int) -> bool:
    versions = status.get("replica_versions", {})
    return len(versions) >= replicas and all(v >= status.get("trainer_version", 0) for v in versions.values())


def finish(launch: Launch, summary: dict) -> None:
    """Copy the run's records next to each other, write summary.json, plots and the final model."""
    out = launch.out
    metrics = read_jsonl(out / "trainer" / "metrics.jsonl")
    evals = read_jsonl(out / "orchestrator" / "eval.jsonl")
    if metrics:
        shutil.copy(out / "trainer" / "metrics.jsonl", out / "metrics.jsonl")
    policy_evals = read_jsonl(out / "orchestrator" / "policy-eval.jsonl")
    for name, rows in (("eval.jsonl", evals), ("policy-eval.jsonl", policy_evals)):
        if rows:
            shutil.copy(out / "orchestrator" / name, out / name)
    by_step: dict[int, dict] = {int(m["step"]): m for m in metrics}  # a resumed step keeps its last line
    summary.update(
        steps=len(by_step), versions=max((int(m["version"]) for m in metrics), default=0),
        tokens=int(sum(m.get("tokens", 0) for m in by_step.values())),
        eval_start=evals[0]["accuracy"] if evals else None, eval_end=evals[-1]["accuracy"] if evals else None,
        evals=[{"version": e["version"], "accuracy": e["accuracy"]} for e in evals],
    )
    if policy_evals:  # π's rounds (orchestrator.policy_eval)
        summary.update(policy_eval_start=policy_evals[0]["accuracy"], policy_eval_end=policy_evals[-1]["accuracy"],
                       policy_evals=[{"version": e["version"], "accuracy": e["accuracy"]} for e in policy_evals])
    try:
        from steadyrl.report import plot_run, save_final_model

        summary["plots"] = plot_run(out, list(by_step.values()), evals)
        summary["final_model"] = save_final_model(launch.model_path, out / "trainer" / "checkpoints",
                                                  out / "final-model")
    except Exception as exc:  # noqa: BLE001 - a report problem must not hide the run's result
        summary["report_error"] = f"{type(exc).__name__}: {exc}"
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
