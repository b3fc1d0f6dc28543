"""Accuracy of a model on a recipe's eval sets, offline, with the torch engine.

The sets, prompts and reward are the run's orchestrator's (`services.orchestrator.data.Tasks`); the fields are
eval.jsonl's: greedy `accuracy`, with k samples `pass_at_k` / `mean_at_k`, and `reward_failures` by reason. By
default the model is scored as given, in `dtype` (π); `served=True` scores it as the replicas serve it (μ: the
inference dtype and the recipe's quantization as the torch engine computes it).

Details: docs/internals/cli.md"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

BATCH = 64
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")  # a model is scored or exported in one of these


def eval_settings(model_dir: str, recipes: Sequence[Path] = (), overrides: Sequence[str] = ()):
    """(orchestrator, inference) settings of a recipe (none: the defaults, the tiny model's arith
    task), with the model to evaluate; ValueError naming a bad field, a missing file or column."""
    from steadyrl.recipe import load_recipe
    from steadyrl.service_settings import settings_for

    config = load_recipe(list(recipes), overrides, allow_empty=True)
    orchestrator, inference = (
        settings_for(config, service, {}, model_dir) for service in ("orchestrator", "inference")
    )
    orchestrator.check_dataset()
    return orchestrator, inference


def evaluate(
    model_dir: str,
    recipes: Sequence[Path] = (),
    overrides: Sequence[str] = (),
    samples: int = 4,
    dtype: str = "float32",
    device: str = "cpu",
    served: bool = False,
) -> dict:
    """`device`: cpu, cuda, or auto (cuda when a GPU is visible); `served`: as the replicas serve it."""
    from services.orchestrator.data import Tasks
    from shared.core.evals import sampled_scores
    from shared.engines import Sampling, make_engine
    from shared.tasks import RewardRunner

    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    settings, inference = eval_settings(model_dir, recipes, overrides)
    quantization = inference.quantization_options() if served else {}
    if served and quantization and inference.engine != "torch":
        raise ValueError(
            f"served=True emulates the torch engine's {inference.quantization}; this recipe serves it "
            f"with {inference.engine}, whose kernels differ"
        )
    dtype = inference.dtype if served else dtype
    tasks = Tasks(settings)
    engine = make_engine("torch", model_dir, dtype, device=device, **quantization)  # a bad device is refused here
    rewards = RewardRunner(inference.tasks.reward_timeout_seconds)  # the replicas' time limit
    for reward in {source.reward for source in tasks.ordered}:
        rewards.check(reward)
    failures: Counter[str] = Counter()  # completions the reward could not score (0 with a reason)

    def rewards_of(problems, sampling: Sampling, repeat: int) -> list[list[float]]:
        """Per (source, example), the rewards of its `repeat` completions, by its source's reward."""
        out: list[list[float]] = []
        for start in range(0, len(problems), BATCH):
            chunk = problems[start : start + BATCH]
            outs = engine.generate(
                [tasks.prompt_ids(e, source) for source, e in chunk for _ in range(repeat)], sampling
            )
            for i, (source, example) in enumerate(chunk):
                texts = [
                    tasks.tokenizer.decode(s.token_ids, skip_special_tokens=True)
                    for s in outs[i * repeat : (i + 1) * repeat]
                ]
                scored = rewards.score(tasks.source(source).reward, texts, example.answer, example.row())
                failures.update(s.reason for s in scored if s.reason)
                out.append([s.value for s in scored])
        return out

    def scores(problems) -> dict:
        greedy = rewards_of(problems, Sampling(temperature=0, max_new_tokens=settings.sampling.max_new_tokens), 1)
        out = {"accuracy": round(sum(r[0] for r in greedy) / len(greedy), 4), "prompts": len(problems)}
        if samples:
            sampled = rewards_of(
                problems,
                Sampling(
                    temperature=settings.evals.temperature,
                    top_p=settings.sampling.top_p,
                    max_new_tokens=settings.sampling.max_new_tokens,
                    seed=1,
                ),
                samples,
            )
            counts = [(samples, sum(r == 1.0 for r in rs)) for rs in sampled]
            out.update(k=samples, **{k: round(v, 4) for k, v in sampled_scores(counts, samples).items()})
        return out

    try:
        sets = {name: scores(problems) for name, problems in tasks.evals.items()}
    finally:
        engine.close()
        rewards.close()
    report = {
        "model": model_dir,
        "task": {s.name: s.data.task for s in tasks.ordered} if settings.data.mixture else settings.data.task,
        "reward": {s.name: s.reward for s in tasks.ordered} if settings.data.mixture else tasks.reward,
        "device": device,
        "dtype": dtype,
        **({"quantization": quantization} if quantization else {}),
        **sets.pop("main"),
        "reward_failures": dict(failures),
    }
    return {**report, "sets": sets} if sets else report
