"""A math task for real models: prompts from a local dataset — JSONL, JSON (a list of rows), CSV,
Parquet, or a directory written by `datasets.Dataset.save_to_disk` — with the prompt and answer
columns named by settings (or found among the usual names), answers checked with math-verify. For a
reward that asks for its row (`shared.tasks.reward_contract`), each example also keeps the row's prompt
as given and its other columns, checked when the data is loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.tasks.registry import Example, register_reward
from shared.tasks.reward_contract import RESERVED, Row

PROMPT_KEYS = ("prompt", "problem", "question")
ANSWER_KEYS = ("answer", "solution", "ground_truth")


def _pick(row: dict, keys: tuple[str, ...], path: Path, index: int) -> tuple[str, str]:
    """(column, its value as text) of the first of `keys` the row has."""
    for key in keys:
        if key in row and row[key] is not None:
            return key, str(row[key])
    raise ValueError(f"{path} row {index}: none of the columns {keys}")


def _json(text: str, where: str) -> object:
    """`text` parsed, or ValueError naming `where` (a nesting past the parser's depth included)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where} is not JSON: {str(exc)[:200]}") from None


def read_rows(path: Path) -> list[dict]:
    """Every row of a local dataset file or saved dataset directory, as dicts."""
    if not path.exists():
        raise ValueError(f"dataset {path} does not exist")
    if path.is_dir():
        return _saved_dataset(path)
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [_json(line, f"{path} line {i}") for i, line in enumerate(f, 1) if line.strip()]
    if path.suffix == ".json":
        rows = _json(path.read_text(), str(path))
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path}: a .json dataset is a list of objects (one per row)")
        return rows
    if path.suffix == ".csv":
        import csv

        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # optional, only for Parquet

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: expected a .jsonl, .json, .csv or .parquet file, or a saved dataset directory")


def _saved_dataset(path: Path) -> list[dict]:
    """A `datasets.Dataset.save_to_disk` directory: Arrow IPC streams listed in state.json."""
    state = path / "state.json"
    if not state.is_file():
        raise ValueError(f"{path} is a directory but no saved dataset (no state.json)")
    import pyarrow as pa  # optional, as for Parquet

    rows: list[dict] = []
    for entry in json.loads(state.read_text()).get("_data_files", []):
        with pa.memory_map(str(path / entry["filename"])) as source:
            rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return rows


def check_columns(path: Path, prompt_column: str = "", answer_column: str = "") -> None:
    """ValueError naming what is missing (the file, or a column in its first row)."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"dataset {path} has no rows")
    for wanted, fallback, what in ((prompt_column, PROMPT_KEYS, "prompt"), (answer_column, ANSWER_KEYS, "answer")):
        keys = (wanted,) if wanted else fallback
        if not any(k in rows[0] for k in keys):
            raise ValueError(
                f"dataset {path} has no {what} column {' or '.join(map(repr, keys))}; its columns: {sorted(rows[0])}"
            )


@dataclass(frozen=True)
class MathTask:
    """Examples from `train_path` / `eval_path`; `template` wraps each problem ({problem})."""

    train_path: str
    eval_path: str | None = None
    template: str = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    name: str = "math"
    reward_name: str = "math_verify"
    prompt_column: str = ""  # empty: the first of PROMPT_KEYS the rows have
    answer_column: str = ""  # empty: the first of ANSWER_KEYS
    columns: bool = False
    """Keep each row's prompt as given and its other columns (but completion, answer, prompt), for a
    reward that asks for them: a row whose columns are no JSON values or too large is refused, named."""

    def split(self, name: str, size: int | None = None) -> list[Example]:
        path = Path(self.train_path if name == "train" else (self.eval_path or self.train_path))
        rows = read_rows(path)
        examples = [self._example(row, path, i) for i, row in enumerate(rows)]
        return examples if size is None else examples[:size]

    def _example(self, row: dict, path: Path, index: int) -> Example:
        prompt_key, problem = _pick(row, (self.prompt_column,) if self.prompt_column else PROMPT_KEYS, path, index)
        answer_key, answer = _pick(row, (self.answer_column,) if self.answer_column else ANSWER_KEYS, path, index)
        prompt = self.template.format(problem=problem)
        if not self.columns:
            return Example(prompt=prompt, answer=answer)
        columns = {k: v for k, v in row.items() if k not in (prompt_key, answer_key) and k not in RESERVED}
        Row(problem, columns).checked(f"{path} row {index}")
        return Example(prompt=prompt, answer=answer, columns=columns, row_prompt=problem)


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
