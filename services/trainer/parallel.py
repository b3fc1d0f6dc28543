"""How the trainer's model is laid over its ranks: the device, the precision, DDP or FSDP2,
activation checkpointing; and the state moved in and out of it (checkpoints, published weights)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from services.trainer.config import TrainerSettings


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (Qwen3, Qwen3-MoE, Mixtral, OLMoE...)."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.layers to shard")
    return layers


def wants_bf16(settings: TrainerSettings, device: torch.device) -> bool:
    return settings.precision == "bf16-mixed" or (settings.precision == "auto" and device.type == "cuda")


def prepare(model: torch.nn.Module, settings: TrainerSettings, device: torch.device, world: int) -> torch.nn.Module:
    """The model on its device, checkpointed and wrapped for data parallelism; returns the module
    the step runs (DDP wrapper, or the FSDP-sharded model itself)."""
    model.config.use_cache = False
    if settings.activation_checkpointing:  # per decoder layer, non-reentrant (replay stays on: shared.forward)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device).train()
    if world <= 1:
        return model
    if settings.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if wants_bf16(settings, device) else MixedPrecisionPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def is_sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full model and optimizer state on rank 0's host (empty elsewhere); a collective when sharded."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def load_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Load a full state: sharded models receive it from rank 0 (the others pass empty dicts)."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=is_sharded(model))
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def gather_published(model: torch.nn.Module, dtype: torch.dtype, rank: int) -> dict[str, torch.Tensor] | None:
    """Sharded model: every tensor gathered in turn (all ranks call this together), cast to the
    published dtype and kept on rank 0's host — the version's bytes, nothing more (None elsewhere)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if rank == 0:
            full = full.detach()
            out[name] = (full.to(dtype) if full.is_floating_point() else full).cpu()
    return out if rank == 0 else None
