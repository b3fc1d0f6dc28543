"""Checkpoints without pickle: sharded tensors in safetensors (torch.distributed.checkpoint), the rest in JSON.

`checkpoints/step-00000012/` holds `shards/` (each rank's shard of the model and the AdamW moments), rng.safetensors
and state.json. DCP reshards on load: a checkpoint resumes on any world size and parallelism. With
`trainer.checkpoint.async_save` a background thread writes the shards. A checkpoint is renamed into place, then named
by `LATEST` atomically: a crash leaves the old or the new one, never half. The checkpoint directory must be one
filesystem for every node. The earlier full-state format is still read.

Details: docs/internals/trainer.md"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

SEP = "::"
MODEL = "model."
OPTIM = "optim."
SHARDS = "shards"


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    consumed: set[str] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)


def is_sharded_checkpoint(path: Path) -> bool:
    return (path / SHARDS).is_dir()


def _options(model: torch.nn.Module) -> StateDictOptions:
    """A model with frozen parameters (a LoRA adapter over its base) is checkpointed without them."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """This rank's part of the model and optimizer state as one flat dict of tensors (DTensors
    when sharded), and the optimizer's param groups (parameter names, not ids: any world size)."""
    options = _options(model)
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)  # initialises AdamW's state
    flat = {MODEL + name: tensor for name, tensor in model_state.items()}
    for name, entry in optimizer_state["state"].items():
        for key, value in entry.items():
            flat[f"{OPTIM}{name}{SEP}{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    return flat, optimizer_state["param_groups"]


def staging_dir(root: Path, step: int, attempt: str) -> Path:
    """Where one attempt at a checkpoint is written: its own directory, so that the shards of an
    attempt a crash cut short (perhaps by another world size) never mix into a later one."""
    return root / f".tmp-step-{step:08d}-{attempt}"


def file_index(flat: dict[str, torch.Tensor], file_bytes: int) -> dict[str, int]:
    """Tensor name → file number (from 1), in order, each file at most `file_bytes` of this rank's
    part unless one tensor is larger. Pure. The writer serialises a file in memory before writing
    it (two copies of it), so the file size bounds what a save adds to a rank's memory."""
    index = {}
    number = 1
    filled = 0
    for name, tensor in flat.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        size = local.numel() * local.element_size()
        if filled and filled + size > file_bytes:
            number = number + 1
            filled = 0
        index[name] = number
        filled = filled + size
    return index


def start_save(
    directory: Path,
    flat: dict[str, torch.Tensor],
    group=None,
    asynchronous: bool = True,
    file_bytes: int = 256 * 1024**2,
) -> Future | None:
    """Every rank: write its shards under `directory/shards/` (all ranks call this, with the same
    directory), in files of about `file_bytes`. Asynchronous: returns once the tensors are staged
    in host memory; the future completes when every rank's shards are written. Blocking: returns
    None when they are."""
    (directory / SHARDS).mkdir(parents=True, exist_ok=True)
    writer = HuggingFaceStorageWriter(
        str(directory / SHARDS), fqn_to_index_mapping=file_index(flat, file_bytes), save_distributed=True
    )
    if asynchronous:
        return dcp.async_save(flat, storage_writer=writer, process_group=group)
    dcp.save(flat, storage_writer=writer, process_group=group)
    return None


def finish_save(tmp: Path, state: TrainerState, param_groups: list, keep: int = 2) -> Path:
    """Rank 0, once every shard is written into `tmp`: state.json and the RNG beside the shards,
    the directory renamed into place, `LATEST` pointed at it, old checkpoints and the directories
    of attempts cut short pruned."""
    root = tmp.parent
    final = tmp.parent / f"step-{state.step:08d}"
    save_file({"cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    meta = {
        "format": "dcp",
        "step": state.step,
        "version": state.version,
        "consumed": list(state.consumed),  # a set: unsorted (sorting 180k ids took 63 ms)
        "counters": state.counters,
        "optimizer": {"param_groups": param_groups},
    }
    (tmp / "state.json").write_text(json.dumps(meta))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / ".LATEST.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "LATEST")
    for old in sorted(p for p in root.glob("step-*") if p != final)[: -(keep - 1) or None]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):  # one save at a time: any other attempt is dead
        shutil.rmtree(stale, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / "LATEST"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def read_state(path: Path) -> TrainerState:
    meta = json.loads((path / "state.json").read_text())
    return TrainerState(meta["step"], meta["version"], set(meta["consumed"]), meta.get("counters", {}))


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group=None) -> TrainerState:
    """Every rank: its part of a sharded checkpoint into the model and optimizer, resharded to
    this world size and layout; restores the RNG."""
    template, _ = flat_state(model, optimizer)
    dcp.load(template, storage_reader=HuggingFaceStorageReader(str(path / SHARDS)), process_group=group)
    meta = json.loads((path / "state.json").read_text())
    model_state = {k[len(MODEL) :]: v for k, v in template.items() if k.startswith(MODEL)}
    optimizer_state: dict[str, dict] = {}
    for key, value in template.items():
        if key.startswith(OPTIM):
            name, item = key[len(OPTIM) :].rsplit(SEP, 1)
            optimizer_state.setdefault(name, {})[item] = value
    set_model_state_dict(model, model_state, options=_options(model))
    set_optimizer_state_dict(
        model,
        optimizer,
        {"state": optimizer_state, "param_groups": meta["optimizer"]["param_groups"]},
        options=_options(model),
    )
    torch.set_rng_state(load_file(str(path / "rng.safetensors"))["cpu"])
    return read_state(path)


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict, TrainerState]:
    """(full model state, full optimizer state, trainer state) of a full-state checkpoint (the
    earlier format); restores the RNG."""
    meta = json.loads((path / "state.json").read_text())
    state: dict[str, dict] = {}
    for key, value in load_file(str(path / "optimizer.safetensors")).items():
        name, item = key.rsplit(SEP, 1)
        state.setdefault(name, {})[item] = value
    for key, value in meta["optimizer"]["scalars"].items():
        name, item = key.rsplit(SEP, 1)
        state.setdefault(name, {})[item] = torch.tensor(value)
    torch.set_rng_state(load_file(str(path / "rng.safetensors"))["cpu"])
    return (
        load_file(str(path / "model.safetensors")),
        {"state": state, "param_groups": meta["optimizer"]["param_groups"]},
        read_state(path),
    )


def load_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of a checkpoint of either format, in one process (an export, a
    test): a sharded one is assembled from every rank's shards by DCP into tensors of the saved
    shapes and dtypes, read from the safetensors headers."""
    if not is_sharded_checkpoint(path):
        return load_file(str(path / "model.safetensors"))
    reader = HuggingFaceStorageReader(str(path / SHARDS))
    stored = reader.read_metadata().state_dict_metadata
    weights = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith(MODEL)
    }
    dcp.load(weights, storage_reader=reader, no_dist=True)
    return {key[len(MODEL) :]: tensor for key, tensor in weights.items()}
