"""Which GPUs each process of a run gets: the trainer `trainer.parallel.gpus` (one torchrun rank each),
every replica its own `inference.gpus_per_replica` (vLLM's tensor_parallel_size; the policy-eval
replica of `orchestrator.evals.policy` is one more), each teacher or judge pool replica its pool's
`gpus_per_replica` (after the rest), disjoint, as CUDA_VISIBLE_DEVICES — or, with `run.colocate`, the
replicas on the trainer's GPUs (replica i on the i-th block of them, wrapping around), so that one
machine with few GPUs holds both. A recipe
that asks for more GPUs than the machine has is refused before any process starts. On a machine
(or a recipe) without GPUs nothing changes: every process sees none."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.trainer.config import ParallelSettings


@dataclass(frozen=True)
class Placement:
    trainer: tuple[int, ...]  # GPU indices of the trainer's ranks (empty: the CPU)
    replicas: tuple[tuple[int, ...], ...]  # GPU indices of each replica
    trainer_ranks: int  # torchrun ranks (1: a plain process)
    pools: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)  # each pool replica's GPUs

    def visible(self, gpus: tuple[int, ...]) -> dict[str, str]:
        """The environment that gives a process exactly `gpus` (none: CUDA hidden)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}

    def trainer_argv(self, master_port: int) -> list[str]:
        """`python` arguments of the trainer: torchrun with one rank per GPU (or per CPU rank)."""
        if self.trainer_ranks <= 1:
            return ["-m", "services.trainer"]
        return [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(self.trainer_ranks),
            "--master_port",
            str(master_port),
            "-m",
            "services.trainer",
        ]


TRAINER = ("-m", "services.trainer")


def node_argv(parallel: ParallelSettings, job: str, node_rank: int | None = None, entry=TRAINER) -> list[str]:
    """`python` arguments of one node of a multi-node trainer (`parallel`: trainer.parallel): torchrun
    meeting the other nodes at weight-sync (`steadyrl.torchrun`, rendezvous backend `steadyrl` at
    `rdzv_endpoint`, behind the deployment's token, as `job`), restarting its ranks up to
    `max_restarts` times (a failed rank, a lost node: the survivors meet again in the next round and
    resume from the checkpoint). With `node_rank` (a JobSet pod's completion index) the node holds
    that node rank, so global rank 0 (the one serving gRPC) is on node 0. Pure."""
    conf = f"join_timeout={parallel.rdzv_timeout_seconds}" + ("" if node_rank is None else f",node_rank={node_rank}")
    return [
        "-m",
        "steadyrl.torchrun",
        "--nnodes",
        str(parallel.nodes),
        "--nproc_per_node",
        str(max(parallel.gpus or parallel.ranks, 1)),
        "--rdzv-backend",
        "steadyrl",
        "--rdzv-endpoint",
        parallel.rdzv_endpoint,
        "--rdzv-id",
        job,
        "--rdzv-conf",
        conf,
        "--max-restarts",
        str(parallel.max_restarts),
        *entry,
    ]


def visible_gpus(devices: dict[str, str]) -> frozenset[str]:
    """The GPUs an environment made by `Placement.visible` gives its process (none: empty)."""
    return frozenset(filter(None, devices.get("CUDA_VISIBLE_DEVICES", "").split(",")))


def plan_placement(
    trainer_gpus: int,
    trainer_ranks: int,
    replicas: int,
    gpus_per_replica: int,
    available: int,
    colocate: bool = False,
    pools: dict[str, tuple[int, int]] | None = None,
) -> Placement:
    """`pools`: name → (replicas, gpus_per_replica) of each teacher or judge pool, placed on GPUs of
    their own after everything else (colocation shares only the trainer's). Pure."""
    pools = pools or {}
    pool_gpus = sum(n * g for n, g in pools.values())
    if colocate:
        if not trainer_gpus or not gpus_per_replica or gpus_per_replica > trainer_gpus:
            raise ValueError(
                f"run.colocate puts the replicas on the trainer's GPUs: it needs trainer.parallel.gpus >= "
                f"inference.gpus_per_replica >= 1 (they are {trainer_gpus} and {gpus_per_replica})"
            )
        if trainer_gpus + pool_gpus > available:
            raise ValueError(
                f"the recipe needs {trainer_gpus + pool_gpus} GPUs (trainer.parallel.gpus, the replicas colocated "
                f"on them{_pools_named(pools)}) and this machine has {available}"
            )
        return Placement(
            tuple(range(trainer_gpus)),
            tuple(
                tuple((i * gpus_per_replica + j) % trainer_gpus for j in range(gpus_per_replica))
                for i in range(replicas)
            ),
            trainer_gpus,
            _place_pools(pools, trainer_gpus),
        )
    need = trainer_gpus + replicas * gpus_per_replica + pool_gpus
    if need > available:
        raise ValueError(
            f"the recipe needs {need} GPUs (trainer.parallel.gpus {trainer_gpus} + {replicas} replicas × "
            f"inference.gpus_per_replica {gpus_per_replica}{_pools_named(pools)}) and this machine has {available}"
        )
    trainer = tuple(range(trainer_gpus))
    first = trainer_gpus
    placed = tuple(
        tuple(range(first + i * gpus_per_replica, first + (i + 1) * gpus_per_replica)) for i in range(replicas)
    )
    pooled = _place_pools(pools, first + replicas * gpus_per_replica)
    return Placement(trainer, placed, trainer_gpus or max(trainer_ranks, 1), pooled)


def _place_pools(pools: dict[str, tuple[int, int]], first: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    out = {}
    for name, (replicas, gpus) in pools.items():
        out[name] = tuple(tuple(range(first + i * gpus, first + (i + 1) * gpus)) for i in range(replicas))
        first += replicas * gpus
    return out


def _pools_named(pools: dict[str, tuple[int, int]]) -> str:
    return "".join(f" + {n} {name} replicas × {g}" for name, (n, g) in pools.items() if n * g)


def gpu_inventory() -> int:
    """GPUs this machine offers (STEADYRL_GPUS overrides; 0 without CUDA)."""
    if "STEADYRL_GPUS" in os.environ:
        return int(os.environ["STEADYRL_GPUS"])
    if "torch" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
        return 0  # no NVIDIA driver: no need to import torch to know
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def placement_of(config, settings: dict, available: int | None = None) -> Placement:
    """The placement of a checked recipe (`steadyrl.service_settings.check`'s settings)."""
    from steadyrl.recipe import POOLS

    trainer = settings["trainer"]
    inference = settings["inference"]
    if config.run.colocate and inference.engine == "vllm" and inference.vllm.gpu_memory_utilization > 0.5:
        raise ValueError(
            "run.colocate shares each GPU between the trainer and a vLLM replica: set "
            f"inference.vllm.gpu_memory_utilization <= 0.5 (it is {inference.vllm.gpu_memory_utilization})"
        )
    return plan_placement(
        trainer.parallel.gpus,
        trainer.parallel.ranks,
        config.replicas + policy_eval_replicas(settings),
        inference.gpus_per_replica,
        gpu_inventory() if available is None else available,
        config.run.colocate,
        {name: (pool.replicas, pool.gpus_per_replica) for name in POOLS if (pool := config.pool(name)) is not None},
    )


def policy_eval_replicas(settings: dict) -> int:
    """Replicas of the policy_eval pool a run needs: one with orchestrator.evals.policy (placed
    after the rollout replicas, like one more of them)."""
    return 1 if settings["orchestrator"].evals.policy else 0
