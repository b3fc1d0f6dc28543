"""How the trainer's model is laid over its ranks: the device, the precision, DDP or FSDP2,
activation checkpointing; and the state moved in and out of it (checkpoints, published weights)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from services.trainer.config import TrainerSettings
from shared.weightsync.manifest import CastView


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (Qwen3, Qwen3-MoE, Mixtral, OLMoE...), inside a
    peft wrapper too."""
    from shared.models.lora import base_model

    inner = base_model(model)
    layers = getattr(getattr(inner, "model", inner), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.layers to shard")
    return layers


def wants_bf16(settings: TrainerSettings, device: torch.device) -> bool:
    if settings.exact:  # the replicas' fp32 forwards (refused with bf16-mixed)
        return False
    return settings.compute.precision == "bf16-mixed" or (
        settings.compute.precision == "auto" and device.type == "cuda"
    )


def prepare(model: torch.nn.Module, settings: TrainerSettings, device: torch.device, world: int) -> torch.nn.Module:
    """The model on its device, checkpointed and wrapped for data parallelism; returns the module
    the step runs (DDP wrapper, or the FSDP-sharded model itself)."""
    model.config.use_cache = False
    if (
        settings.compute.activation_checkpointing
    ):  # per decoder layer, non-reentrant (replay stays on: services.trainer.forward)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device).train()
    if world <= 1:
        return model
    if settings.parallel.mode in ("fsdp", "hsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if wants_bf16(settings, device)
            else MixedPrecisionPolicy()
        )
        mesh = device_mesh(settings, device, world)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


def prepare_reference(
    model: torch.nn.Module, settings: TrainerSettings, device: torch.device, world: int
) -> torch.nn.Module:
    """A frozen reference model (a KL term's π_ref) laid out like the policy: on its device, no
    gradients, sharded per decoder layer under fsdp/hsdp (each rank holds its part), whole under
    ddp (no gradients, so no DDP wrapper)."""
    model.config.use_cache = False
    model.requires_grad_(False)
    model.to(device).eval()
    if world > 1 and settings.parallel.mode in ("fsdp", "hsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = wants_bf16(settings, device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
        mesh = device_mesh(settings, device, world)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def shard_layout(parallel: str, world: int, shard_ranks: int, local_world: int) -> tuple[int, int]:
    """(replicas, ranks per shard group) of a sharded model; pure. fsdp: one group of every rank."""
    if parallel != "hsdp":
        return 1, world
    shard = shard_ranks or local_world
    if shard < 1 or world % shard:
        raise ValueError(
            f"trainer.parallel.mode = 'hsdp': the world ({world} ranks) is not a whole number of shard "
            f"groups of {shard} ranks (trainer.parallel.shard_ranks, 0 = the ranks of one node)"
        )
    return world // shard, shard


def device_mesh(settings: TrainerSettings, device: torch.device, world: int):
    """The ranks' device mesh: 1-D (fsdp), or replicate × shard (hsdp)."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    replicas, shard = shard_layout(
        settings.parallel.mode, world, settings.parallel.shard_ranks, int(os.environ.get("LOCAL_WORLD_SIZE", world))
    )
    if settings.parallel.mode != "hsdp":
        return init_device_mesh(device.type, (world,))
    return init_device_mesh(device.type, (replicas, shard), mesh_dim_names=("replicate", "shard"))


def is_sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full model and optimizer state on rank 0's host (empty elsewhere); a collective when sharded."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def load_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
) -> None:
    """Load a full state: sharded models receive it from rank 0 (the others pass empty dicts)."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=is_sharded(model))
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def gather_published(tensors: Mapping[str, torch.Tensor]) -> None:
    """One pass of a sharded model's published tensors (its state dict, or a LoRA adapter's),
    gathered in turn (every rank calls this with rank 0's `GatheredView`, which uses each tensor as
    it comes; the others drop theirs)."""
    for tensor in tensors.values():
        if hasattr(tensor, "full_tensor"):
            tensor.full_tensor()


class GatheredView(CastView):
    """Rank 0's view of a sharded model as the version it publishes: each tensor gathered from the
    shards when the transport reads it, cast to the published dtype, and dropped once used — no
    second copy of the model on any rank. Every rank gathers together: each pass over the tensors
    (a transport reads them once or twice: digests, then bytes) starts with `start_pass`, which
    tells the other ranks to gather one pass with it. Read in order, each tensor once per pass;
    `finish` completes a pass a failed transport left half-way, so no rank waits on a gather."""

    device = torch.device("cpu")

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, start_pass: Callable[[], None], adapter=None
    ) -> None:
        super().__init__(tensors, dtype, adapter)
        self.start_pass = start_pass
        self.names = list(self.tensors)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.next = 0  # the tensor the current pass reads next (0: no pass under way)
        self.passes = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.index[name] != self.next:
            raise RuntimeError(f"a gathered view is read in order: {name} asked for, {self.names[self.next]} is next")
        if self.next == 0:
            self.start_pass()
            self.passes += 1
        tensor = self.tensors[name]
        full = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()
        self.next = (self.next + 1) % len(self.names)
        return (full.to(self.dtype) if full.is_floating_point() else full).cpu()

    def piece_source(self, name: str) -> None:
        return None  # a shard: the tensor is gathered whole, in its turn

    def finish(self) -> None:
        while self.next:
            self[self.names[self.next]]
