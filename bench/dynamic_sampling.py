"""Dynamic sampling benchmark: the tiny demo run twice for the same number of steps, without and with
`trainer.dynamic_sampling` (groups with equal rewards filtered, the batch kept full), one after the
other on the same machine. Prints one JSON object: trained tokens per second of each (all of them,
and those of groups with unequal rewards, the ones that carry a gradient), the filtered share, the
wall time and the evals, and the ratios with / without.

Trained tokens: the loss-mask tokens of every step (`tokens` in metrics.jsonl); seconds: from the end
of the first step to the end of the last (start-up and the final checkpoint not counted)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny-arith.toml"
VARIANTS = {"without": "false", "with": "true"}


def summarise(lines: list[dict], evals: list[dict], batch_prompts: int) -> dict:
    """What one run trained, from its metrics.jsonl lines and eval.jsonl rounds (B groups a step). Pure."""
    lines = sorted(lines, key=lambda m: m["step"])
    seconds = (lines[-1]["unix_ms"] - lines[0]["unix_ms"]) / 1000 if len(lines) > 1 else None
    timed = lines[1:]  # the steps inside `seconds`
    tokens = sum(m["tokens"] for m in timed)
    informative = sum(m["tokens"] * (1 - m.get("zero_variance_share", 0.0)) for m in timed)
    filtered = sum(m.get("filtered_groups", 0) for m in lines)
    trained_groups = len(lines) * batch_prompts
    return {
        "steps": len(lines),
        "seconds": round(seconds, 2) if seconds else None,
        "tokens_trained_per_s": round(tokens / seconds, 1) if seconds else None,
        "informative_tokens_per_s": round(informative / seconds, 1) if seconds else None,
        "filtered_groups": filtered,
        "filtered_share": round(filtered / (filtered + trained_groups), 4) if trained_groups else None,
        "zero_variance_share_trained": round(sum(m.get("zero_variance_share", 0.0) for m in lines) / len(lines), 4),
        "evals": {int(e["version"]): e["accuracy"] for e in sorted(evals, key=lambda e: e["version"])},
    }


def main(steps: int = 200, overrides: list[str] = ()) -> dict:
    """Each variant a whole `steadyrl run` of configs/tiny-arith.toml, as a user starts it."""
    import tomllib

    from bench.demo_run import ratio, run_demo

    batch_prompts = tomllib.loads(RECIPE.read_text())["run"]["batch_prompts"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, enabled in VARIANTS.items():
            out = Path(tmp) / name
            settings = [
                f"run.steps={steps}",
                f"trainer.dynamic_sampling.enabled={enabled}",
                "orchestrator.evals.every=50",
                f'run.id="bench-ds-{name}"',
                *overrides,
            ]
            lines, evals, summary = run_demo([RECIPE], out, settings)
            results[name] = {"wall_seconds": summary.get("wall_seconds"), **summarise(lines, evals, batch_prompts)}
    on, off = results["with"], results["without"]
    return {
        "benchmark": "dynamic_sampling",
        "recipe": "configs/tiny-arith.toml",
        "steps": steps,
        "variants": results,
        "ratios": {
            "tokens_trained_per_s": ratio(on["tokens_trained_per_s"], off["tokens_trained_per_s"]),
            "informative_tokens_per_s": ratio(on["informative_tokens_per_s"], off["informative_tokens_per_s"]),
            "seconds": ratio(on["seconds"], off["seconds"]),
        },
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)))
