"""Accuracy of a model on a task's eval split: greedy and sampled, with the torch engine."""

from __future__ import annotations

from pathlib import Path


def evaluate(model_dir: str, task: str = "arith", size: int = 300, samples: int = 4, max_new_tokens: int = 8,
             math_path: Path | None = None, dtype: str = "float32") -> dict:
    from shared.engines import Sampling, make_engine
    from shared.models import load_tokenizer
    from shared.models.loading import encode_prompt
    from shared.models.tiny import TinySpec
    from shared.tasks import MathTask, get_reward

    if task == "arith":
        examples = TinySpec().task().split("eval", size)
        reward = get_reward("exact_match")
    elif task == "math":
        if math_path is None:
            raise ValueError("task math needs --math-path")
        examples = MathTask(math_path).split("eval", size)
        reward = get_reward("math_verify")
    else:
        raise ValueError(f"unknown task {task!r}; arith or math")
    engine = make_engine("torch", model_dir, dtype)
    tokenizer = load_tokenizer(model_dir)
    prompts = [encode_prompt(tokenizer, e.prompt) for e in examples]

    def accuracy(sampling: Sampling, repeat: int) -> float:
        total = 0.0
        for start in range(0, len(prompts), 64):
            chunk = prompts[start : start + 64]
            outs = engine.generate([p for p in chunk for _ in range(repeat)], sampling)
            for i, sample in enumerate(outs):
                example = examples[start + i // repeat]
                total += reward(tokenizer.decode(sample.token_ids, skip_special_tokens=True), example.answer)
        return total / (len(prompts) * repeat)

    try:
        return {
            "model": model_dir, "task": task, "prompts": len(prompts),
            "greedy_accuracy": round(accuracy(Sampling(temperature=0, max_new_tokens=max_new_tokens), 1), 4),
            "sampled_accuracy": round(accuracy(Sampling(temperature=1.0, max_new_tokens=max_new_tokens, seed=1),
                                               samples), 4),
            "samples_per_prompt": samples,
        }
    finally:
        engine.close()
