"""A math task for real models: prompts from a local JSONL or Parquet file, answers checked with
math-verify (the `math` extra)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.tasks.registry import Example, register_reward

PROMPT_KEYS = ("prompt", "problem", "question")
ANSWER_KEYS = ("answer", "solution", "ground_truth")


def _pick(row: dict, keys: tuple[str, ...], path: Path, index: int) -> str:
    for key in keys:
        if key in row and row[key] is not None:
            return str(row[key])
    raise ValueError(f"{path} row {index}: none of the fields {keys}")


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # optional, only for Parquet

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: expected a .jsonl or .parquet file")


@dataclass(frozen=True)
class MathTask:
    """Examples from `train_path` / `eval_path`; `template` wraps each problem ({problem})."""

    train_path: str
    eval_path: str | None = None
    template: str = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    name: str = "math"
    reward_name: str = "math_verify"

    def split(self, name: str, size: int | None = None) -> list[Example]:
        path = Path(self.train_path if name == "train" else (self.eval_path or self.train_path))
        rows = read_rows(path)
        examples = [
            Example(
                prompt=self.template.format(problem=_pick(row, PROMPT_KEYS, path, i)),
                answer=_pick(row, ANSWER_KEYS, path, i),
            )
            for i, row in enumerate(rows)
        ]
        return examples if size is None else examples[:size]


@register_reward("math_verify")
def math_verify_reward(completion: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's final answer equal to the reference.

    math-verify's own time limits use signal.alarm, which works only on a main thread: they are
    off here, and the reward process that runs this reward (shared.tasks.reward_runner) bounds
    its time instead, on whatever thread the caller is."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=None)
    predicted = parse(completion, parsing_timeout=None)
    return 1.0 if gold and predicted and verify(gold, predicted, timeout_seconds=None) else 0.0
