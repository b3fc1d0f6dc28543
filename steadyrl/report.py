"""The run directory's report: PNG plots of the diagnostics and the final model as an HF folder."""

from __future__ import annotations

import shutil
from pathlib import Path

PLOTS = [
    ("reward_mean", "reward"),
    ("entropy", "entropy"),
    ("mismatch_kl_k3", "mismatch KL (k3)"),
    ("is_weight_mean", "IS weight mean"),
    ("is_weight_max", "IS weight max"),
    ("clip_frac", "clip fraction"),
    ("staleness_mean", "staleness mean"),
    ("routing_agreement", "routing agreement"),
    # multi-turn runs
    ("turns_mean", "model turns per trajectory"),
    ("turn_tokens_mean", "model tokens per turn"),
    ("env_tool_calls", "tool calls per trajectory"),
    ("env_tool_success", "tool-call success rate"),
    ("env_tool_errors", "tool errors per trajectory"),
]


def plot_run(out: Path, metrics: list[dict], evals: list[dict]) -> list[str]:
    """One PNG per diagnostic vs step (and eval accuracy vs version); returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    series = sorted(metrics, key=lambda m: m["step"])
    for key, title in PLOTS:
        points = [(m["step"], m[key]) for m in series if key in m]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(*zip(*points, strict=True), linewidth=1.2)
        ax.set_xlabel("step")
        ax.set_title(title)
        if key == "mismatch_kl_k3" and all(v > 0 for _, v in points):
            ax.set_yscale("log")
        fig.tight_layout()
        fig.savefig(plots / f"{key}.png", dpi=100)
        plt.close(fig)
        written.append(f"plots/{key}.png")
    if evals:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([e["version"] for e in evals], [e["accuracy"] for e in evals], marker="o")
        ax.set_xlabel("policy version")
        ax.set_title("eval accuracy (greedy)")
        fig.tight_layout()
        fig.savefig(plots / "eval_accuracy.png", dpi=100)
        plt.close(fig)
        written.append("plots/eval_accuracy.png")
    return written


def save_final_model(model_path: str, checkpoints: Path, target: Path) -> str | None:
    """The last checkpoint's weights as a Hugging Face directory (config, tokenizer, safetensors):
    the one the trainer wrote at its last step when it holds that checkpoint (services/trainer/final_model.py),
    else exported from the checkpoint here (a sharded or LoRA trainer, a run stopped before its end)."""
    from services.trainer.final_model import MARKER, written_final_model

    written = written_final_model(checkpoints)
    if written is not None:
        (written / MARKER).unlink()
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(written, target)
        return str(target)
    from services.trainer.checkpoint import latest_checkpoint

    found = latest_checkpoint(checkpoints)
    return None if found is None else str(export_checkpoint(model_path, found, target))


def find_checkpoint(source: Path) -> tuple[Path, str | None]:
    """(checkpoint step directory, the base model it trained, if the run says) of a step directory,
    a checkpoints directory (its LATEST) or a `steadyrl run` directory."""
    import json

    from services.trainer.checkpoint import latest_checkpoint

    model = None
    if (source / "summary.json").exists():
        model = json.loads((source / "summary.json").read_text()).get("model")
    if (source / "trainer" / "checkpoints").is_dir():
        source = source / "trainer" / "checkpoints"
    step = source if (source / "state.json").exists() else latest_checkpoint(source)
    if step is None or not ((step / "model.safetensors").exists() or (step / "shards").is_dir()):
        raise ValueError(
            f"no trainer checkpoint in {source} (a step-* directory, a checkpoints directory with "
            "LATEST, or a run directory)"
        )
    return step, model


def export_checkpoint(
    model_path: str, checkpoint: Path, target: Path, dtype: str = "float32", merge: bool = True
) -> Path:
    """A trainer checkpoint (whatever the parallelism and world size that wrote it: its shards are
    consolidated by DCP) as a Hugging Face directory in `dtype`: the base model's config and
    tokenizer, the checkpoint's weights. A LoRA checkpoint (its adapter_config.json) is merged into
    the base (the run's final model, evaluations), or with `merge` False written as the adapter
    alone in PEFT's format (adapter_config.json + adapter_model.safetensors:
    `PeftModel.from_pretrained(base, target)`; what `steadyrl export` writes unless --merge)."""
    from services.trainer.checkpoint import load_model_weights
    from shared.models import load_causal_lm
    from shared.models.loading import copy_tokenizer_files, resolve_dtype

    model = load_causal_lm(model_path, "float32")
    weights = load_model_weights(checkpoint)
    if (checkpoint / "adapter_config.json").exists():
        model = _adapter(model, checkpoint, weights, target, merge)
        if model is None:
            return target
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise ValueError(
                f"checkpoint {checkpoint} does not fit the model {model_path}: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
    model.to(resolve_dtype(dtype)).save_pretrained(target)
    copy_tokenizer_files(model_path, target)
    return target


def _adapter(model, checkpoint: Path, weights: dict, target: Path, merge: bool):
    """The base with the checkpoint's adapter merged in (`merge`), else None once the adapter is
    written to `target` in PEFT's format."""
    from peft import LoraConfig, get_peft_model

    from shared.models.lora import merged_state

    adapted = get_peft_model(model, LoraConfig.from_pretrained(str(checkpoint)))
    missing, unexpected = adapted.load_state_dict(weights, strict=False)
    if unexpected or any(".lora_" in m for m in missing):
        raise ValueError(
            f"the adapter of {checkpoint} does not fit the model: missing "
            f"{[m for m in missing if '.lora_' in m][:3]}, unexpected {unexpected[:3]}"
        )
    if not merge:
        adapted.save_pretrained(str(target))
        return None
    state = merged_state(adapted)
    base = adapted.base_model.model
    merged = type(base)(base.config)
    merged.load_state_dict(state)
    return merged
