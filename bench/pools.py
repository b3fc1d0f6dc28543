"""Pool benchmark in one run: the torch engine's scoring (a teacher's prefill) against its generation
on the demo's step; a cold-started student on a format only the kit's tiny teacher knows, trained by
RL alone and distilled from that teacher (configs/tiny-distill.toml: rollouts per second with the
pool / without, steps to a target eval and to the teacher's, and each final model's accuracy beside
the teacher's on 1,200 held-out problems no eval saw); and RL on the tiny judge's verdicts
(configs/tiny-judge.toml: eval gain, judge/exact agreement per step, rollouts per second). One JSON
object.

Details: docs/internals/bench.md"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny-arith.toml"
JUDGED = ROOT / "configs" / "tiny-judge.toml"
DISTILLED = ROOT / "configs" / "tiny-distill.toml"


def steps_to(evals: list[dict], target: float) -> int | None:
    """The first version at which two consecutive evals average `target` or more (None: never). Pure."""
    evals = sorted(evals, key=lambda e: e["version"])
    for before, at in zip(evals, evals[1:], strict=False):
        if (before["accuracy"] + at["accuracy"]) / 2 >= target:
            return int(at["version"])
    return None


def rollouts_per_second(lines: list[dict], batch: int) -> float | None:
    """Rollouts trained per second from the end of the first step to the end of the last. Pure."""
    lines = sorted(lines, key=lambda m: m["step"])
    if len(lines) < 2:
        return None
    return round((len(lines) - 1) * batch / ((lines[-1]["unix_ms"] - lines[0]["unix_ms"]) / 1000), 1)


def scoring_vs_generation(model: str, sequences: int = 256, tokens: int = 6, rounds: int = 3) -> dict:
    from shared.engines import Sampling, make_engine
    from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts

    engine = make_engine("torch", model, "float32", threads=1)
    try:
        examples = TinySpec().task(0).split("train", sequences // 8)
        prompts = [p for p in encode_prompts(char_tokenizer(), [e.prompt for e in examples]) for _ in range(8)]
        generate, score = [], []
        for r in range(rounds):
            started = time.perf_counter()
            samples = engine.generate(prompts, Sampling(temperature=1.0, max_new_tokens=tokens, seed=r + 1))
            generate.append(time.perf_counter() - started)
            pairs = [(p, s.token_ids) for p, s in zip(prompts, samples, strict=True)]
            started = time.perf_counter()
            engine.score(pairs)
            score.append(time.perf_counter() - started)
        completion = sum(len(s.token_ids) for s in samples)
    finally:
        engine.close()
    gen_rate = completion / sorted(generate)[rounds // 2]
    score_rate = completion / sorted(score)[rounds // 2]
    return {
        "sequences": sequences,
        "generate_tokens_per_s": round(gen_rate, 1),
        "score_tokens_per_s": round(score_rate, 1),
        "score_over_generate": round(score_rate / gen_rate, 2),
    }


def fresh_accuracy(model: Path | str, evals: int, size: int = 1500) -> float:
    """Greedy accuracy (fp32) of a model on the teacher task's held-out problems past the first `evals`
    (those a run's evals score): a figure neither a run's evals nor the teacher's build looked at."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.kit.tiny import char_tokenizer, greedy_accuracy
    from shared.kit.tiny_teacher import teacher_task

    model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return round(greedy_accuracy(model, char_tokenizer(), teacher_task().split("eval", size)[evals:]), 4)


def judged_run(lines: list[dict], evals: list[dict], batch: int) -> dict:
    """A judged run's figures: evals, the gain from the first eval to the last and to the best, and
    the judge's agreement with exact match over all steps, the first tenth and the last tenth. Pure."""
    evals = sorted(evals, key=lambda e: e["version"])
    accuracy = [e["accuracy"] for e in evals]
    agreement = [m["judge_agreement"] for m in sorted(lines, key=lambda m: m["step"])]
    tenth = max(len(agreement) // 10, 1)
    return {
        "rollouts_per_s": rollouts_per_second(lines, batch),
        "evals": {int(e["version"]): round(e["accuracy"], 3) for e in evals},
        "eval_gain_end": round(accuracy[-1] - accuracy[0], 3),
        "eval_gain_best": round(max(accuracy) - accuracy[0], 3),
        "judge_agreement_mean": round(sum(agreement) / len(agreement), 3),
        "judge_agreement_first_tenth": round(sum(agreement[:tenth]) / tenth, 3),
        "judge_agreement_last_tenth": round(sum(agreement[-tenth:]) / tenth, 3),
    }


def main(steps: int = 2000, target: float = 0.5, judge_steps: int = 200) -> dict:
    import tomllib

    from bench.demo_run import ratio, run_demo
    from shared.kit.tiny import init_tiny_model
    from shared.kit.tiny_judge import init_tiny_judge
    from shared.kit.tiny_teacher import init_tiny_teacher

    recipe = tomllib.loads(RECIPE.read_text())["run"]
    batch = recipe["batch_prompts"] * recipe["group_size"]
    result = {"benchmark": "pools", "recipe": "configs/tiny-distill.toml", "steps": steps, "target_accuracy": target}
    result["teacher_scoring"] = scoring_vs_generation(str(init_tiny_model()))
    teacher_dir = init_tiny_teacher()
    teacher = json.loads((teacher_dir / "steadyrl_tiny.json").read_text())
    evals_size = tomllib.loads(DISTILLED.read_text())["orchestrator"]["evals"]["size"]
    teacher["fresh"] = fresh_accuracy(teacher_dir, evals_size)
    evals_every = [f"run.steps={steps}", "orchestrator.evals.every=25", f"orchestrator.evals.size={evals_size}"]
    sides = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # RL alone: the same task and recipe without the teacher pool (tiny-arith.toml on unpadded sums)
        for name, recipes, settings in (
            ("rl", [RECIPE], ["orchestrator.data.arith_fixed_width=false"]),
            ("distill", [DISTILLED], []),
        ):
            lines, evals, _ = run_demo(recipes, tmp / name, [*evals_every, *settings])
            sides[name] = {
                "rollouts_per_s": rollouts_per_second(lines, batch),
                "steps_to_target": steps_to(evals, target),
                "steps_to_teacher": steps_to(evals, teacher["held_out"]),
                "evals": {int(e["version"]): round(e["accuracy"], 3) for e in evals},
                "final_fresh": fresh_accuracy(tmp / name / "final-model", evals_size),
            }
        lines, evals, _ = run_demo([JUDGED], tmp / "judge", [f"run.steps={judge_steps}", "orchestrator.evals.every=25"])
        judge = judged_run(lines, evals, batch)
    report = json.loads((init_tiny_judge() / "steadyrl_tiny.json").read_text())
    judge.update(
        steps=judge_steps,
        recipe="configs/tiny-judge.toml",
        held_out=report["held_out"],
        held_out_policy=report["held_out_policy"],
    )
    rl, distill = sides["rl"], sides["distill"]
    result.update(
        teacher={
            "held_out": teacher["held_out"],
            "fresh": teacher["fresh"],
            "student_before": teacher["student_accuracy"],
            "sft_steps": teacher["sft_steps"],
        },
        rl=rl,
        distill=distill,
        judge=judge,
        ratios={
            "rollouts_per_s_with_judge_over_rule": ratio(judge["rollouts_per_s"], rl["rollouts_per_s"]),
            "score_over_generate_tokens_per_s": result["teacher_scoring"]["score_over_generate"],
            "rollouts_per_s_with_teacher_over_without": ratio(distill["rollouts_per_s"], rl["rollouts_per_s"]),
            # RL alone short of the target within the run: its steps are more than `steps`, the ratio an upper bound
            "steps_to_target_distill_over_rl": ratio(distill["steps_to_target"], rl["steps_to_target"] or steps),
            "rl_reached_target": rl["steps_to_target"] is not None,
            "steps_to_teacher_distill_over_rl": ratio(distill["steps_to_teacher"], rl["steps_to_teacher"] or steps),
            "rl_reached_teacher": rl["steps_to_teacher"] is not None,
            "final_fresh_distill_over_teacher": ratio(distill["final_fresh"], teacher["fresh"]),
            "final_fresh_rl_over_teacher": ratio(rl["final_fresh"], teacher["fresh"]),
        },
    )
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
