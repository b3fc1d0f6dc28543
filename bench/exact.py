"""`steadyrl bench exact`: exact mode's cost and whether the demo learns as well with it: the torch
engine's tokens/s on the demo's step (exact / normal bf16 and fp32), a demo-sized trainer step's
seconds (each batch one version behind, as the async demo trains; normal / exact), and the demo
with and without exact mode, pairs run in turn, eval at equal steps. Prints one JSON object.

Details: docs/internals/bench.md#benchexactpy"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUPS, GROUP, NEW_TOKENS = 32, 8, 6


def _prompts():
    from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts

    return encode_prompts(char_tokenizer(), [e.prompt for e in TinySpec().task(0).split("train", GROUPS)])


def engine_side(rounds: int) -> dict:
    import torch

    from shared.engines import Sampling, make_engine
    from shared.kit.tiny import init_tiny_model

    torch.set_num_threads(1)
    model_dir = str(init_tiny_model(task="arith"))
    prompts = [p for p in _prompts() for _ in range(GROUP)]
    sampling = Sampling(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    engines = {
        "exact": make_engine("torch", model_dir, "float32", threads=1, max_num_seqs=len(prompts), exact=True),
        "normal_bf16": make_engine("torch", model_dir, "bfloat16", threads=1, max_num_seqs=len(prompts)),
        "normal_fp32": make_engine("torch", model_dir, "float32", threads=1, max_num_seqs=len(prompts)),
    }

    def step(engine) -> int:  # as a replica's tasks come: group by group, with routing traces
        futures = [
            f for g in range(0, len(prompts), GROUP) for f in engine.start_many(prompts[g : g + GROUP], sampling, True)
        ]
        return sum(len(f.result().token_ids) for f in futures)

    rates: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for engine in engines.values():
            step(engine)  # warm-up
        for _ in range(rounds):
            for name, engine in engines.items():
                started = time.perf_counter()
                tokens = step(engine)
                rates[name].append(tokens / (time.perf_counter() - started))
    finally:
        for engine in engines.values():
            engine.close()
    out: dict = {"sequences": len(prompts), "new_tokens": NEW_TOKENS, "threads": 1, "rounds": rounds}
    out.update({f"{name}_tokens_per_s": round(statistics.median(r), 1) for name, r in rates.items()})
    for normal in ("normal_bf16", "normal_fp32"):
        pairs = [e / n for e, n in zip(rates["exact"], rates[normal], strict=True)]
        out[f"exact_over_{normal}"] = round(statistics.median(pairs), 3)
        out[f"exact_over_{normal}_spread"] = [round(min(pairs), 3), round(max(pairs), 3)]
    return out


def trainer_side(rounds: int) -> dict:
    """As the async demo trains: each batch sampled by the exact engine with version v's weights and
    trained at v + 1 (one version behind), by an exact and a normal runner in turn."""
    import torch

    from services.trainer.config import TrainerSettings
    from services.trainer.model_runner import StepRunner
    from shared.engines import Sampling, make_engine
    from shared.kit.tiny import init_tiny_model
    from shared.rollouts.record import RolloutTimings
    from shared.rollouts.samples import rollouts_from_samples
    from shared.rpc.steadyrl.v1 import common_pb2

    torch.set_num_threads(1)
    model_dir = str(init_tiny_model(task="arith"))
    prompts = _prompts()
    engine = make_engine("torch", model_dir, "float32", threads=1, max_num_seqs=256, exact=True)

    def sample(runner: StepRunner, version: int, seed: int) -> list:
        engine.update_weights(version, {k: v.detach().clone() for k, v in runner.model.state_dict().items()})
        samples = engine.generate(
            [p for p in prompts for _ in range(GROUP)],
            Sampling(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=seed),
            return_trace=True,
        )
        batch = []
        for g, prompt in enumerate(prompts):
            task = common_pb2.PromptTask(task_id=f"v{version}s{seed}t{g}", prompt_token_ids=prompt)
            mine = samples[g * GROUP : (g + 1) * GROUP]
            rewards = [float(i % 2) for i in range(GROUP)]
            batch += rollouts_from_samples(task, mine, rewards, "b", "torch", RolloutTimings())
        return batch

    seconds: dict[str, list[float]] = {"exact": [], "normal": []}
    checked = []
    with tempfile.TemporaryDirectory(prefix="steadyrl-bench-exact-") as tmp:
        runners = {
            name: StepRunner(
                TrainerSettings(
                    model_path=model_dir,
                    out_dir=Path(tmp) / name,
                    batch_prompts=GROUPS,
                    group_size=GROUP,
                    max_staleness=1,
                    exact=name == "exact",
                    optim={"lr": 1e-3},
                    compute={"torch_threads": 1},
                    publish={"dtype": "float32"},
                )
            )
            for name in seconds
        }
        first, pending = sample(runners["exact"], 0, 1), sample(runners["exact"], 0, 2)
        for runner in runners.values():
            runner.step(first, 0)  # warm-up, at staleness 0
        for version in range(1, rounds + 1):
            sampled = sample(runners["exact"], version, version + 2)  # the next batch, by this version
            for name, runner in runners.items():
                started = time.perf_counter()
                metrics = runner.step(pending, version)  # one version behind, as the demo trains
                seconds[name].append(time.perf_counter() - started)
                if name == "exact":
                    checked.append((metrics["exact_tokens"], metrics["tokens"], metrics["staleness_peak"]))
            pending = sampled
    engine.close()
    pairs = [n / e for e, n in zip(seconds["exact"], seconds["normal"], strict=True)]
    return {
        "rollouts": len(pending),
        "rounds": rounds,
        "exact_step_seconds": round(statistics.median(seconds["exact"]), 4),
        "normal_step_seconds": round(statistics.median(seconds["normal"]), 4),
        "normal_over_exact_step_seconds": round(statistics.median(pairs), 3),
        "normal_over_exact_spread": [round(min(pairs), 3), round(max(pairs), 3)],
        "exact_tokens_checked": sum(c[0] for c in checked),
        "tokens": sum(c[1] for c in checked),
        "staleness_peak": max(c[2] for c in checked),
    }


def demo_side(pairs: int) -> dict:
    from bench.demo_run import run_demo
    from bench.load import Load

    def one(recipe: str, out: Path) -> dict:
        started = time.perf_counter()
        with Load() as load:
            metrics, evals, summary = run_demo([ROOT / "configs" / recipe], out, [])
        stamps = [m["unix_ms"] for m in metrics]
        return {
            "command_seconds": round(time.perf_counter() - started, 1),
            "steps_seconds": round((stamps[-1] - stamps[0]) / 1000 * len(stamps) / max(len(stamps) - 1, 1), 1),
            "evals": {str(e["version"]): round(e["accuracy"], 4) for e in evals},
            "exact_tokens": sum(m.get("exact_tokens", 0) for m in metrics),
            "tokens": sum(m["tokens"] for m in metrics),
            "dropped": summary["final_status"]["progress"]["dropped"],
            **load.record(),
        }

    runs: dict[str, list[dict]] = {"exact": [], "normal": []}
    with tempfile.TemporaryDirectory(prefix="steadyrl-bench-exact-demo-") as tmp:
        for i in range(pairs):
            runs["normal"].append(one("tiny-arith.toml", Path(tmp) / f"normal-{i}"))
            runs["exact"].append(one("tiny-arith-exact.toml", Path(tmp) / f"exact-{i}"))
    versions = sorted(runs["exact"][0]["evals"], key=int)
    at_equal_steps = {
        v: {side: [min(r["evals"][v] for r in rs), max(r["evals"][v] for r in rs)] for side, rs in runs.items()}
        for v in versions
    }
    ratio = [n["steps_seconds"] / e["steps_seconds"] for n, e in zip(runs["normal"], runs["exact"], strict=True)]
    return {
        "pairs": pairs,
        "runs": runs,
        "eval_at_equal_steps": at_equal_steps,  # version → side → [min, max] over the runs
        "normal_over_exact_steps_seconds": round(statistics.median(ratio), 3),
        "normal_over_exact_spread": [round(min(ratio), 3), round(max(ratio), 3)],
    }


def main(pairs: int = 3) -> dict:
    return {
        "benchmark": "exact",
        "aim": {"exact_over_normal_throughput": 0.5},
        "engine": engine_side(rounds=5),
        "trainer": trainer_side(rounds=5),
        "demo": demo_side(pairs),
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)))
