"""The run's final model written by the trainer at its last step, beside its checkpoints: the launcher
moves it into place instead of loading the last checkpoint again (`steadyrl.report.save_final_model`).
Written only where this one process holds the whole model as the base's own weights (one rank, no
LoRA adapter); elsewhere the launcher exports the checkpoint."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

log = logging.getLogger("steadyrl.trainer")
DIRECTORY = "final-model"  # under the trainer's out_dir
MARKER = "exported-step.json"  # {"step": N}: the checkpoint step whose weights the directory holds


def write_final_model(model, model_path: str, out_dir: Path, step: int) -> Path | None:
    """`model` (an unwrapped transformers model) saved as a Hugging Face directory with the base's
    tokenizer files, marked with `step`; None when writing failed (logged: the launcher exports)."""
    from shared.models.loading import copy_tokenizer_files

    target = out_dir / DIRECTORY
    staging = out_dir / f"{DIRECTORY}.partial"
    try:
        shutil.rmtree(staging, ignore_errors=True)
        base = json.loads((Path(model_path) / "config.json").read_text())
        training = model.config.use_cache  # off while training: the model exported generates as the base does
        model.config.use_cache = base.get("use_cache", True)
        try:
            model.save_pretrained(staging)
        finally:
            model.config.use_cache = training
        copy_tokenizer_files(model_path, staging)
        (staging / MARKER).write_text(json.dumps({"step": step}))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    except OSError as exc:
        log.warning("event=final_model_failed error=%s: the launcher exports the checkpoint", exc)
        return None
    log.info("event=final_model_written step=%d path=%s", step, target)
    return target


def written_final_model(checkpoints: Path) -> Path | None:
    """The trainer's final model beside `checkpoints` when it holds their latest (LATEST), else None.
    Reads files only: the launcher asks without importing torch."""
    pointer = checkpoints / "LATEST"
    state = checkpoints / pointer.read_text().strip() / "state.json" if pointer.exists() else None
    marker = checkpoints.parent / DIRECTORY / MARKER
    if state is None or not state.exists() or not marker.exists():
        return None
    step = json.loads(state.read_text())["step"]
    return marker.parent if json.loads(marker.read_text()).get("step") == step else None
