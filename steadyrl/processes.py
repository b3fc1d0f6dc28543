"""The processes of one `steadyrl run` on loopback: what each is (`Service`: command, settings, port, GPUs), starting
them, waiting for their health, the control plane's client, and stopping them (SIGTERM, then SIGKILL after a grace
period). Ports: steadyrl/ports.py; restarts are the supervisor's (steadyrl/supervisor.py).

Details: docs/internals/cli.md"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.runstore.redis_server import RedisServer
from shared.runtime.service_main import parent_death_signal
from steadyrl.placement import placement_of, visible_gpus
from steadyrl.ports import PortReservations
from steadyrl.recipe import POOLS, SERVICES, Recipe, recipe_section, resolve_pool_model
from steadyrl.service_settings import pool_values, settings_env, settings_for, validate


@dataclass
class Service:
    name: str
    argv: list[str]  # after `python`: ["-m", "services.trainer"], or torchrun's
    env: dict[str, str]  # STEADYRL_<SERVICE>_* (validated against the service's settings)
    grpc_port: int
    devices: dict[str, str] = field(default_factory=dict)  # CUDA_VISIBLE_DEVICES
    process: subprocess.Popen | None = None
    log: Path | None = None
    ports: tuple[int, ...] = ()  # every port it listens on, held by the launcher until it starts


@dataclass
class Launch:
    config: Recipe
    out: Path
    model_path: str
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    redis_password: str = field(default_factory=lambda: secrets.token_hex(24))  # never "--…" (an option to redis)
    services: list[Service] = field(default_factory=list)
    redis: RedisServer | None = None
    http_port: int = 0
    gpus_available: int | None = None  # None: this machine's (steadyrl.placement.gpu_inventory)
    ports: PortReservations = field(default_factory=PortReservations)
    http: object | None = None  # the control plane's httpx.Client, made at the first call and kept
    shm_claim: int | None = None  # the flock held on this run's shm folder (shared.weightsync.shm_folders)
    swept: list[Path] = field(default_factory=list)  # version folders of stopped runs of this recipe, removed
    placed_over: list[str] = field(default_factory=list)  # settings the recipe sets that this launch places

    # --- setup ----------------------------------------------------------------------------------

    def inference_replicas(self) -> int:
        """The replicas this run started, π's (orchestrator.evals.policy) too: the final status waits
        for each to report the last version."""
        return sum(s.name.startswith("inference") for s in self.services)

    def plan(self, redis_url: str) -> None:
        """Every service's command, environment, port and devices (nothing starts here)."""
        from shared.runtime.private_files import write_private
        from shared.weightsync.signing import write_key_pair

        c = self.config
        out = self.out
        settings = {service: c.settings(service) for service in SERVICES}  # checked: `launcher.run`
        placement = placement_of(c, settings, self.gpus_available)
        ws, trainer, master, orch_grpc = (self.ports.take() for _ in range(4))
        self.http_port = self.ports.take()
        # only the trainer signs; a run's directory is new, its keys too
        signing_key, verify_key = (str(p) for p in write_key_pair(out / "keys", replace=True))
        common = {"host": "127.0.0.1", "metrics_port": 0}
        shm = {} if "shm_dir" in c.section("weightsync") else {"shm_dir": str(settings["trainer"].publish.shm_dir)}
        self.services.append(
            Service(
                "weightsync",
                ["-m", "services.weightsync"],
                self.env_of(
                    "weightsync",
                    {
                        **common,
                        "port": ws,
                        "spill_dir": str(out / "weightsync-spill"),
                        "verify_key_file": verify_key,
                        "redis_url": redis_url,  # the run's instance, which every version must carry
                        **shm,
                    },
                ),
                ws,
                placement.visible(()),
                ports=(ws,),
            )
        )
        self.services.append(
            Service(
                "trainer",
                placement.trainer_argv(master),
                self.env_of(
                    "trainer",
                    {
                        **common,
                        "port": trainer,
                        "model_path": self.model_path,
                        "out_dir": str(out / "trainer"),
                        "redis_url": redis_url,
                        "weightsync_address": f"127.0.0.1:{ws}",
                        "publish": {"signing_key_file": signing_key},
                    },
                ),
                trainer,
                placement.visible(placement.trainer),
                ports=(trainer, master),
            )
        )
        addresses = {}
        for pool in POOLS:
            replicas = self.pool_services(pool, common, redis_url, placement)
            if replicas:
                addresses[pool] = {"addresses": [f"127.0.0.1:{r.grpc_port}" for r in replicas]}
        policy = {
            "pool": "policy_eval",
            "quantization": "none",
            "quantize_router": False,
            "quantize_activations": False,
        }  # π: the published weights, unquantised
        for index in range(len(placement.replicas)):
            port = self.ports.take()
            is_policy = index == c.replicas
            self.services.append(
                Service(
                    "inference-policy" if is_policy else f"inference-{index}",
                    ["-m", "services.inference"],
                    self.env_of(
                        "inference",
                        {
                            **common,
                            "port": port,
                            "model_path": self.model_path,
                            "redis_url": redis_url,
                            "replica_id": "replica-policy" if is_policy else f"replica-{index}",
                            "weightsync_address": f"127.0.0.1:{ws}",
                            "orchestrator_address": f"127.0.0.1:{orch_grpc}",
                            "agent": {"hidden_paths": [str(out.resolve())]},
                            "verify_key_file": verify_key,
                            **(policy if is_policy else addresses),
                        },
                    ),
                    port,
                    placement.visible(placement.replicas[index]),
                    ports=(port,),
                )
            )
        write_private(out / "token", self.token, 0o600, replace=True)
        self.services.append(
            Service(
                "orchestrator",
                ["-m", "services.orchestrator"],
                self.env_of(
                    "orchestrator",
                    {
                        "host": "127.0.0.1",
                        "http_port": self.http_port,
                        "grpc_port": orch_grpc,
                        "model_path": self.model_path,
                        "out_dir": str(out / "orchestrator"),
                        "redis_url": redis_url,
                        "trainer_address": f"127.0.0.1:{trainer}",
                        "token_file": str(out / "token"),
                    },
                ),
                orch_grpc,
                placement.visible(()),
                ports=(orch_grpc, self.http_port),
            )
        )

    def env_of(self, service: str, placed: dict) -> dict[str, str]:
        """The variables of one process of `service`: the recipe's section and what the launch
        places, checked once here (the recipe itself was checked before anything started)."""
        table = self.config.section(service)
        for key in sorted(_leaves(placed) & _leaves(table)):
            if f"{service}.{key}" not in self.placed_over:
                self.placed_over.append(f"{service}.{key}")
        return settings_env(settings_for(self.config, service, placed, self.model_path))

    def pool_services(self, name: str, common: dict, redis_url: str, placement) -> list[Service]:
        """The [teacher] or [judge] pool's replicas (none without one): inference processes in pool
        `name` on the pool's fixed weights, on their own GPUs (or the CPU), answering Score (teacher)
        or Judge (judge) to the rollout replicas."""
        pool = self.config.pool(name)
        if pool is None:
            return []
        services = []
        for index in range(pool.replicas):
            port = self.ports.take()
            values = {
                **pool_values(self.config, name),
                **common,
                "port": port,
                "model_path": resolve_pool_model(pool.path),
                "redis_url": redis_url,
                "replica_id": f"{name}-{index}",
            }
            env = settings_env(recipe_section("inference", values))
            devices = placement.visible(placement.pools[name][index])
            services.append(Service(f"{name}-{index}", ["-m", "services.inference"], env, port, devices, ports=(port,)))
        self.services.extend(services)
        return services

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
        env.update(
            service.env,
            **service.devices,
            STEADYRL_LOG_LEVEL=os.environ.get("STEADYRL_LOG_LEVEL", "INFO"),
            STEADYRL_TOKEN_FILE=str(self.out / "token"),
        )  # one bearer token for gRPC and HTTP
        self.ports.release(*service.ports)  # bound by this process until now: nothing else could take them
        with service.log.open("ab") as log:  # a launcher killed outright (SIGKILL) takes its services with it
            service.process = subprocess.Popen(
                [sys.executable, *service.argv],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=parent_death_signal(signal.SIGTERM),
            )

    def start_redis(self) -> RedisServer:
        """redis-server with AOF on, on a port drawn like the services' (below the ephemeral range)."""
        port = self.ports.take()
        self.ports.release(port)  # redis-server binds it next
        self.redis = RedisServer(
            self.out / "redis", port=port, appendonly=True, password=self.redis_password, with_parent=True
        ).start()
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
            if service.name == "weightsync":  # the run's instance is made: before the trainer's first version
                self.claim_shm_folder()
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
        options = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ]
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
        """One control-plane call, on a client kept for the run (a new client per call loads the
        CA bundle again: most of a poll's CPU)."""
        import httpx

        from shared.rpc.tls import httpx_options, tls_from_env

        if self.http is None:
            tls = tls_from_env()
            self.http = httpx.Client(
                base_url=f"{'https' if tls else 'http'}://127.0.0.1:{self.http_port}",
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=10,
                **httpx_options(tls),
            )
        reply = self.http.request(method, path)
        reply.raise_for_status()
        return reply.json()

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
        if self.http is not None:
            self.http.close()
            self.http = None
        instance = self.run_instance()
        if self.redis is not None:
            self.redis.stop()
        root = self.shm_root()
        if root is not None and instance is not None:  # this run's shared-memory version files (RAM, not disk)
            from shared.weightsync.shm_folders import release_run_folder

            if not release_run_folder(root, self.config.run_id, instance, self.shm_claim) and self.shm_claim:
                os.close(self.shm_claim)  # not this run's claim after all: a later run's sweep removes the folder
            self.shm_claim = None

    def shm_root(self) -> Path | None:
        """Where the trainer's shared-memory version folders go (None: no trainer planned)."""
        trainer = next((s for s in self.services if s.name == "trainer"), None)
        if trainer is None:
            return None
        return Path(trainer.env.get("STEADYRL_TRAINER_PUBLISH__SHM_DIR", "/dev/shm/steadyrl"))

    def claim_shm_folder(self) -> None:
        """Once the run has its instance (weight-sync made it): remove what killed runs of this recipe
        left in shared memory, and claim this run's folder while the launcher lives."""
        from shared.weightsync.shm_folders import claim_run_folder, sweep_run_folders

        root, instance = self.shm_root(), self.run_instance()
        if root is None or not instance or self.shm_claim is not None:
            return
        self.swept = sweep_run_folders(root, self.config.run_id, keep=instance)
        self.shm_claim = claim_run_folder(root, self.config.run_id, instance)

    def run_instance(self) -> str | None:
        """The run's instance as its Redis holds it ("" when none was made: unsigned weights), or
        None when Redis cannot say (its version files are then left in place, not guessed at)."""
        if self.redis is None or self.redis.process is None or self.redis.process.poll() is not None:
            return None
        import redis

        from shared.runstore.keys import RunKeys

        try:
            with redis.Redis.from_url(self.redis.url, socket_timeout=5) as client:
                value = client.get(RunKeys(self.config.run_id).instance)
        except redis.RedisError:
            return None
        return value.decode() if value else ""

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
    return [
        frozenset(s.name for s in services[:i] if visible_gpus(s.devices) & visible_gpus(service.devices))
        for i, service in enumerate(services)
    ]


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)  # the service and anything it spawned (vLLM workers)


def _leaves(table: dict, prefix: str = "") -> set[str]:
    """The dotted names of a table's values (`publish.signing_key_file`)."""
    return {
        name
        for key, value in table.items()
        for name in (_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key})
    }
