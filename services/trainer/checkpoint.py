"""Checkpoints without pickle: tensors in safetensors, everything else in JSON.

`checkpoints/step-00000012/` holds model.safetensors (the model's state dict), optimizer.safetensors
(AdamW moments, one entry per parameter index and state key), rng.safetensors (torch's CPU RNG
state) and state.json (step, version, optimizer param groups and scalar state, consumed rollout
ids). A checkpoint is written into a temporary directory and renamed into place, then `LATEST`
is replaced atomically: a crash leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    consumed: set[str] = field(default_factory=set)
    counters: dict[str, int] = field(default_factory=dict)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{index}.{key}"] = value.contiguous()
            else:
                scalars[f"{index}.{key}"] = float(value)
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def save_checkpoint(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
                    keep: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _optimizer_tensors(optimizer)
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


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    meta = json.loads((path / "state.json").read_text())
    tensors = load_file(str(path / "optimizer.safetensors"))
    entries: dict[int, dict] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        entries.setdefault(int(index), {})[name] = value
    for key, value in meta["optimizer"]["scalars"].items():
        index, name = key.split(".", 1)
        entries.setdefault(int(index), {})[name] = torch.tensor(value)
    optimizer.load_state_dict({"state": entries, "param_groups": meta["optimizer"]["param_groups"]})
    torch.set_rng_state(load_file(str(path / "rng.safetensors"))["cpu"])
    return TrainerState(meta["step"], meta["version"], set(meta["consumed"]), meta.get("counters", {}))
