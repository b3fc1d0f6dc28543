"""Tasks and rewards: deterministic disjoint splits, rewards that never raise."""

import json
from pathlib import Path

import pytest

from shared.tasks import ArithTask, MathTask, get_reward, register_reward, reward_names


def test_arith_splits_are_deterministic_disjoint_and_correct():
    task = ArithTask(digits=3, seed=7)
    train, again = task.split("train", 500), task.split("train", 500)
    assert train == again
    evaluation = task.split("eval", 200)
    assert not {e.prompt for e in train} & {e.prompt for e in evaluation}
    for e in train[:50]:
        a, b = e.prompt.rstrip("=").split("+")
        assert int(e.answer) == int(a) + int(b)
    # every last digit of the sum appears in eval (no split by digit pattern)
    assert {e.answer[-1] for e in evaluation} == set("0123456789")
    assert ArithTask(digits=3, seed=8).split("train", 10) != task.split("train", 10)


def test_arith_fixed_width_and_reversed_format():
    task = ArithTask(digits=3, fixed_width=True, reverse=True)
    assert task.example(5, 71).prompt == "005+071="
    assert task.example(5, 71).answer == "6700"  # 076 → width 4 "0076" → reversed
    assert task.example(999, 999).answer == "8991"
    assert ArithTask(digits=3).example(5, 71).answer == "76"


def test_arith_split_errors():
    with pytest.raises(ValueError, match="split must be"):
        ArithTask().split("test", 1)
    with pytest.raises(ValueError, match="allows 15"):
        ArithTask(digits=1).split("eval", 16)


def test_exact_match_reward():
    reward = get_reward("exact_match")
    assert reward("579", "579") == 1.0
    assert reward(" 579\n", "579") == 1.0
    assert reward("578", "579") == 0.0
    assert reward("", "579") == 0.0


def test_rewards_never_raise_and_unknown_names_are_clear():
    @register_reward("test_explodes")
    def explodes(completion, answer):
        raise RuntimeError("boom")

    @register_reward("test_nan")
    def nan(completion, answer):
        return float("nan")

    assert get_reward("test_explodes")("x", "y") == 0.0
    assert get_reward("test_nan")("x", "y") == 0.0
    assert "exact_match" in reward_names()
    with pytest.raises(KeyError, match="no reward named 'nope'"):
        get_reward("nope")


def test_math_task_reads_jsonl_and_verifies(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"problem": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"}, {"question": "2+2?", "solution": "4"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    examples = MathTask(train_path=str(path)).split("train")
    assert [e.answer for e in examples] == ["\\frac{3}{4}", "4"]
    assert "What is 1/2 + 1/4?" in examples[0].prompt and "\\boxed{}" in examples[0].prompt
    reward = get_reward("math_verify")
    assert reward("so the answer is \\boxed{0.75}", "\\frac{3}{4}") == 1.0
    assert reward("\\boxed{3/4}", "\\frac{3}{4}") == 1.0
    assert reward("\\boxed{5}", "4") == 0.0
    assert reward("\x00\\boxed{{{", "4") == 0.0
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "x"}))
    with pytest.raises(ValueError, match="none of the columns"):
        MathTask(train_path=str(tmp_path / "bad.jsonl")).split("train")


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "saved"])
def test_every_dataset_format_reads_the_same_rows_with_named_columns(tmp_path, kind):
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    from shared.tasks.math_task import check_columns

    rows = [{"q": "1+1?", "a": "2", "extra": "x"}, {"q": "3*3?", "a": "9", "extra": "y"}]
    path = tmp_path / (f"data.{kind}" if kind != "saved" else "saved")
    if kind == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["q", "a", "extra"])
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:  # the layout datasets.Dataset.save_to_disk writes: Arrow IPC streams listed in state.json
        path.mkdir()
        table = pa.Table.from_pylist(rows)
        with (
            pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as w,
        ):
            w.write_table(table)
        (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    task = MathTask(train_path=str(path), template="{problem}", prompt_column="q", answer_column="a")
    assert [(e.prompt, e.answer) for e in task.split("train")] == [("1+1?", "2"), ("3*3?", "9")]
    check_columns(path, "q", "a")
    with pytest.raises(ValueError, match=r"no answer column 'answer_text'; its columns: \['a', 'extra', 'q'\]"):
        check_columns(path, "q", "answer_text")
    with pytest.raises(ValueError, match="no prompt column 'prompt' or 'problem' or 'question'"):
        check_columns(path)


@pytest.mark.process  # starts a steadyrl process: not in the fast tier
def test_a_missing_dataset_or_column_stops_the_run_before_anything_starts(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    for extra, message in (
        (["orchestrator.data.math_path=" + str(tmp_path / "missing.jsonl")], "does not exist"),
        (
            ["orchestrator.data.math_path=" + str(data), "orchestrator.data.answer_column=gold"],
            "no answer column 'gold'",
        ),
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "steadyrl.cli",
                "run",
                str(root / "configs" / "tiny-arith.toml"),
                "--set",
                "orchestrator.data.task=math",
                *[a for x in extra for a in ("--set", x)],
                "--out",
                str(tmp_path / "run"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=root,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr[-1500:]
        assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="expected a .jsonl, .json, .csv or .parquet"):
        (tmp_path / "x.txt").write_text("")
        MathTask(train_path=str(tmp_path / "x.txt")).split("train")


def test_math_evals_never_measure_memorisation(tmp_path):
    from services.orchestrator.config import OrchestratorSettings
    from services.orchestrator.data import dataset

    def write(name, problems):
        path = tmp_path / name
        path.write_text("\n".join(json.dumps({"problem": p, "answer": str(i)}) for i, p in enumerate(problems)))
        return path

    train = write("train.jsonl", [f"problem {i}" for i in range(10)])
    data = {"task": "math", "math_path": train, "train_size": 100}
    settings = dict(model_path="m", evals={"size": 3})
    held_train, held_eval, _ = dataset(
        OrchestratorSettings(**settings, data=data)
    )  # no eval file: the last rows held out
    assert [e.prompt.split("\n")[0] for e in held_eval] == ["problem 7", "problem 8", "problem 9"]
    assert len(held_train) == 7 and not {e.prompt for e in held_train} & {e.prompt for e in held_eval}
    overlapping = write("eval.jsonl", ["problem 2", "a new problem"])
    with pytest.raises(ValueError, match="1 eval problems are also training problems"):
        dataset(OrchestratorSettings(**settings, data={**data, "math_eval_path": overlapping}))
    _, evals, _ = dataset(
        OrchestratorSettings(**settings, data={**data, "math_eval_path": overlapping, "allow_eval_overlap": True})
    )
    assert len(evals) == 2
    separate = write("separate.jsonl", ["another problem"])
    full_train, evals, reward = dataset(OrchestratorSettings(**settings, data={**data, "math_eval_path": separate}))
    assert len(full_train) == 10 and len(evals) == 1 and reward == "math_verify"
    with pytest.raises(ValueError, match="too few to hold out"):
        dataset(OrchestratorSettings(model_path="m", evals={"size": 10}, data=data))


def test_mul_trace_answers_are_worked_traces_with_a_heavy_tail():
    from shared.tasks.trace import MulTraceTask

    task = MulTraceTask(max_answer_tokens=256, alpha=1.3, seed=0)
    assert task.example(3, 14).answer == "14,28,42" and task.example(3, 14).prompt == "3*14="
    train = task.split("train", 3000)
    evals = task.split("eval", 300)
    lengths = sorted(len(e.answer) for e in train)
    median = lengths[len(lengths) // 2]
    p99 = lengths[int(0.99 * len(lengths))]
    assert lengths[-1] <= 256 and p99 >= 150 and median <= 16  # mostly short, a few near the cap
    assert not {e.prompt for e in train} & {e.prompt for e in evals}  # disjoint splits
    assert task.split("train", 50) == train[:50]  # deterministic
    with pytest.raises(ValueError, match="max_answer_tokens"):
        MulTraceTask(max_answer_tokens=4)


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def test_prompts_go_through_the_tokenizers_chat_template_when_it_has_one(tmp_path, tiny_model_dir):
    import shutil

    from services.orchestrator.config import OrchestratorSettings
    from services.orchestrator.data import Tasks
    from shared.models import load_tokenizer

    raw = Tasks(OrchestratorSettings(model_path=str(tiny_model_dir), evals={"size": 5}, data={"train_size": 5}))
    example = raw.train[0]
    plain = list(raw.make("t", example, 2, 1.0, False, 0).prompt_token_ids)
    tokenizer = load_tokenizer(tiny_model_dir)  # transformers' (the orchestrator reads tokenizer.json alone)
    assert plain == [tokenizer.bos_token_id, *tokenizer.encode(example.prompt, add_special_tokens=False)]

    # the same tokenizer with a chat template
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    chat = Tasks(
        OrchestratorSettings(
            model_path=str(tmp_path), evals={"size": 5}, data={"train_size": 5, "system_prompt": "be exact"}
        )
    )
    ids = list(chat.make("t", example, 2, 1.0, False, 0).prompt_token_ids)
    messages = [{"role": "system", "content": "be exact"}, {"role": "user", "content": example.prompt}]
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ids == list(want) and ids != plain
    assert tokenizer.decode(ids) == f"s:be exact u:{example.prompt} a:"  # what the template renders
    off = Tasks(
        OrchestratorSettings(
            model_path=str(tmp_path), evals={"size": 5}, data={"train_size": 5, "chat_template": "none"}
        )
    )
    assert list(off.make("t", example, 2, 1.0, False, 0).prompt_token_ids) == plain


def test_train_tasks_carry_the_overlong_shaping_and_evals_do_not(tiny_model_dir):
    from services.orchestrator.config import OrchestratorSettings
    from services.orchestrator.data import Tasks

    tasks = Tasks(
        OrchestratorSettings(
            model_path=str(tiny_model_dir),
            evals={"size": 5},
            data={"train_size": 5},
            sampling={"max_new_tokens": 6, "overlong_buffer": 2, "overlong_penalty": 0.5},
        )
    )
    example = tasks.train[0]
    train = tasks.make("t", example, 2, 1.0, False, 0)
    evaluated = tasks.make("e", example, 1, 0.0, True, 0)
    assert (train.overlong.buffer_tokens, train.overlong.penalty) == (2, 0.5)
    assert not evaluated.HasField("overlong")


def test_prompts_tokenized_in_one_batch_equal_one_by_one():
    from shared.kit.tiny import char_tokenizer
    from shared.models.loading import encode_prompt, encode_prompts

    tokenizer = char_tokenizer()
    texts = ["12+34=", "", "7+8=", "12+34=", "99+99="]
    batch = encode_prompts(tokenizer, texts)
    assert batch == [encode_prompt(tokenizer, t) for t in texts]
    assert batch[1] == [tokenizer.bos_token_id] and all(ids[0] == tokenizer.bos_token_id for ids in batch)
    assert encode_prompts(tokenizer, []) == []
