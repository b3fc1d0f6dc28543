"""The run directory's report: PNG plots of the diagnostics and the final model as an HF folder."""

from __future__ import annotations

import shutil
from pathlib import Path

PLOTS = [
    ("reward_mean", "reward"), ("entropy", "entropy"), ("mismatch_kl_k3", "mismatch KL (k3)"),
    ("is_weight_mean", "IS weight mean"), ("is_weight_max", "IS weight max"), ("clip_frac", "clip fraction"),
    ("staleness_mean", "staleness mean"), ("routing_agreement", "routing agreement"),
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
    """The last checkpoint's weights as a Hugging Face directory (config, tokenizer, safetensors)."""
    from safetensors.torch import load_file

    from services.trainer.checkpoint import latest_checkpoint
    from shared.models import load_causal_lm

    found = latest_checkpoint(checkpoints)
    if found is None:
        return None
    model = load_causal_lm(model_path, "float32")
    model.load_state_dict(load_file(str(found / "model.safetensors")))
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        source = Path(model_path) / name
        if source.exists() and not (target / name).exists():
            shutil.copy(source, target / name)
    return str(target)
