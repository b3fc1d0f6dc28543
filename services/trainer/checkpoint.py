"""Checkpoints without pickle: tensors in safetensors, everything else in JSON.

`checkpoints/step-00000012/` holds model.safetensors (the full model state, parameter names as in
`state_dict()`), optimizer.safetensors (AdamW moments, keyed `<parameter name>::<state key>`),
rng.safetensors (torch's CPU RNG state) and state.json (step, version, the optimizer's param
groups and scalar state, the trained rollout ids). The same full-state format serves one process,
DDP and FSDP: under FSDP the ranks gather it to rank 0, which writes it, and a restore broadcasts
it back into every rank's shards (torch.distributed.checkpoint.state_dict). Chosen over per-rank
DCP shards so that one checkpoint is readable by any parallelism and by `steadyrl export`; the
cost is rank 0's host memory during a save (the fp32 parameters and two AdamW moments).

A checkpoint is written into a temporary directory and renamed into place, then `LATEST` is
replaced atomically: a crash leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SEP = "::"


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    consumed: set[str] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)


def _split_optimizer(optimizer_state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for name, entry in optimizer_state.get("state", {}).items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{name}{SEP}{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{name}{SEP}{key}"] = float(value)
    return tensors, {"param_groups": optimizer_state.get("param_groups", []), "scalars": scalars}


def save_checkpoint(root: Path, model_state: dict[str, torch.Tensor], optimizer_state: dict, state: TrainerState,
                    keep: int = 2) -> Path:
    """Write one checkpoint from full (gathered) state dicts; returns its directory."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _split_optimizer(optimizer_state)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    save_file({"cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    meta = {"step": state.step, "version": state.version, "consumed": sorted(state.consumed),
            "counters": state.counters, "optimizer": opt_meta}
    (tmp / "state.json").write_text(json.dumps(meta))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / ".LATEST.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "LATEST")
    for old in sorted(p for p in root.glob("step-*") if p != final)[:-(keep - 1) or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / "LATEST"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict, TrainerState]:
    """(full model state, full optimizer state, trainer state) of a checkpoint; restores the RNG."""
    meta = json.loads((path / "state.json").read_text())
    state: dict[str, dict] = {}
    for key, value in load_file(str(path / "optimizer.safetensors")).items():
        name, item = key.rsplit(SEP, 1)
        state.setdefault(name, {})[item] = value
    for key, value in meta["optimizer"]["scalars"].items():
        name, item = key.rsplit(SEP, 1)
        state.setdefault(name, {})[item] = torch.tensor(value)
    torch.set_rng_state(load_file(str(path / "rng.safetensors"))["cpu"])
    trainer = TrainerState(meta["step"], meta["version"], set(meta["consumed"]), meta.get("counters", {}))
    return load_file(str(path / "model.safetensors")), {"state": state, "param_groups": meta["optimizer"]["param_groups"]}, \
        trainer


def load_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """Only the model's tensors of a checkpoint (for an export)."""
    return load_file(str(path / "model.safetensors"))
