"""A reward may take the problem's dataset row (the prompt and the other columns) by keyword, read from
its signature once; the two-argument form is called as before. The row travels with a task only when the
reward takes it, JSON values only and bounded, refused where it enters: a dataset row when the data is
loaded, a forged task's row when the replica leases it, and a task without one still scores."""

import json
from types import SimpleNamespace

import pytest

from shared.rpc.steadyrl.v1 import common_pb2
from shared.runstore.queues import Lease
from shared.tasks import MathTask, register_reward
from shared.tasks.registry import score
from shared.tasks.reward_contract import MAX_COLUMNS_BYTES, MAX_ROW_BYTES, Reward, Row
from shared.tasks.reward_runner import RewardRunner, check_reward


def two(completion, answer):
    return 1.0


def named(completion, answer, *, prompt="", difficulty=0):
    return difficulty


def anything(completion, answer, **row):
    return len(row)


def optional_positional(completion, answer, strict=False):
    return float(strict)


def test_what_a_reward_takes_is_read_from_its_signature():
    assert Reward.of(two).takes == frozenset() and not Reward.of(two).takes_row
    assert Reward.of(named).takes == {"prompt", "difficulty"}
    assert Reward.of(anything).takes is None and Reward.of(anything).takes_row
    assert Reward.of(optional_positional).takes == {"strict"}  # a column of that name would reach it
    assert Reward.of(len).takes == frozenset()  # a builtin without a signature: the two-argument form


def test_each_form_gets_what_it_takes_of_the_row():
    row = Row("2+3=", {"difficulty": 4, "source": "gsm8k"})
    assert Reward.of(two).keywords(row) == {} and Reward.of(two).select(row) is None
    assert Reward.of(named).keywords(row) == {"prompt": "2+3=", "difficulty": 4}
    assert Reward.of(named).select(row) == Row("2+3=", {"difficulty": 4})  # no column nobody reads
    assert Reward.of(anything).keywords(row) == {"prompt": "2+3=", "difficulty": 4, "source": "gsm8k"}
    assert Reward.of(named).keywords(None) == {}  # a task without a row: the defaults
    assert Reward.of(lambda c, a, *, source="": 0).select(Row("p", {})) is None  # nothing of it here
    assert score(named, "x", "y", Reward.of(named).keywords(row)) == (4.0, "")
    assert score(two, "x", "y") == (1.0, "")


def test_a_row_round_trips_through_json():
    row = Row("Ünïcode 2+3=", {"n": 3, "x": 0.5, "ok": True, "none": None, "tags": ["a", {"b": [1]}]})
    assert Row.from_json(row.to_json()) == row
    assert Row.from_json(Row(None, {"n": 1}).to_json()) == Row(None, {"n": 1})
    assert Row.from_json("") is None  # an older task, or a reward that takes nothing


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "an object of 'prompt' and 'columns' expected"),
        ('{"prompt": "p", "extra": 1}', "an object of 'prompt' and 'columns' expected"),
        ('{"prompt": 5}', "its prompt is not text"),
        ('{"columns": [1]}', "its columns are not an object"),
        ('{"columns": {"answer": "42"}}', "column 'answer' cannot be passed to a reward"),
        ('{"columns": {"x": NaN}}', "not JSON"),
        ('{"columns": {"x": 1e999}}', "holds inf, not a finite number"),
        ('{"columns": {"x": ' + "[" * 40 + "]" * 40 + "}}", "nests deeper than 32"),
        ('{"columns": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}", "not JSON"),  # past the parser's recursion
        ('{"columns": {"x": "' + "a" * MAX_COLUMNS_BYTES + '"}}', f"past the {MAX_COLUMNS_BYTES}-byte limit"),
        ('{"prompt": "' + "a" * MAX_ROW_BYTES + '"}', f"past the {MAX_ROW_BYTES}-byte limit"),
        ("{", "not JSON"),
    ],
)
def test_a_forged_row_is_refused_naming_why(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Row.from_json(text)


def test_a_leased_task_with_a_forged_row_is_unservable_and_one_without_a_row_is_served():
    from services.inference.leased_work import Unservable, check_lease

    engine = SimpleNamespace(vocab_size=64, max_model_len=64)
    task = common_pb2.PromptTask(
        task_id="t", task_name="exact_match", prompt_token_ids=[1, 2], group_size=1, answer="3"
    )
    task.sampling.max_new_tokens = 4
    assert check_lease(Lease("t", task, 0), "", engine, None, RewardRunner()).prompt == [1, 2]
    task.reward_row = '{"columns": {"x": NaN}}'
    with pytest.raises(Unservable) as refused:
        check_lease(Lease("t", task, 0), "", engine, None, RewardRunner())
    assert refused.value.code == "reward_row" and "not JSON" in refused.value.message


def test_math_rows_keep_their_prompt_as_given_and_other_columns_only_when_asked(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [
        {"question": "1+1?", "result": "2", "difficulty": 1, "meta": {"source": "a"}, "completion": "x"},
        {"question": "2+2?", "result": "4", "difficulty": 3, "meta": {"source": "b"}, "completion": "y"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    plain = MathTask(str(path), prompt_column="question", answer_column="result").split("train")
    assert [(e.prompt.split("\n")[0], e.answer, e.columns) for e in plain] == [("1+1?", "2", {}), ("2+2?", "4", {})]
    kept = MathTask(str(path), prompt_column="question", answer_column="result", columns=True).split("train")
    assert kept[1].prompt == plain[1].prompt  # the model's prompt is the template's, as before
    # the reward's: the prompt as the row gives it, every other column but one named like an argument
    assert kept[1].row() == Row("2+2?", {"difficulty": 3, "meta": {"source": "b"}})


def test_a_row_with_too_large_columns_is_refused_when_loaded_naming_it(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"problem": "p0", "answer": "0", "notes": "short"}, {"problem": "p1", "answer": "1", "notes": "n" * 70_000}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert len(MathTask(str(path)).split("train")) == 2  # a reward that takes no row: loaded as before
    with pytest.raises(ValueError, match=r"rows.jsonl row 1: its extra columns are 70012 bytes as JSON, past the"):
        MathTask(str(path), columns=True).split("train")


@pytest.mark.process  # a reward process
def test_a_reward_process_passes_each_form_what_it_takes():
    runner = RewardRunner(timeout=30)
    row = Row("2+3=", {"difficulty": 4, "source": "gsm8k", "weight": 0.5})
    try:
        # the prompt's length / 1000 + difficulty × exact match: both arguments arrived
        assert [s.value for s in runner.score("tests.rewards_with_row:difficulty", ["5", "6"], "5", row)] == [
            4.004,
            0.004,
        ]
        assert runner.score("tests.rewards_with_row:everything", ["5"], "5", row)[0].value == 4 + 4.5
        assert runner.score("tests.rewards:length", ["abc"], "5", row)[0].value == 3.0  # called as today
        assert runner.score("tests.rewards_with_row:difficulty", ["5"], "5")[0].value == 0.0  # no row: defaults
        assert runner.score("tests.rewards_with_row:difficulty", ["5"], "5", Row(None, {}))[0].value == 0.0
    finally:
        runner.close()


def test_an_inline_reward_gets_the_row_on_the_callers_thread():
    @register_reward("test_row_inline", inline=True)
    def with_prompt(completion, answer, *, prompt=""):
        return float(completion == prompt)

    runner = RewardRunner()
    assert [s.value for s in runner.score("test_row_inline", ["2+3=", "5"], "5", Row("2+3=", {}))] == [1.0, 0.0]


@pytest.mark.process  # the dry call runs in a reward process
def test_the_dry_call_passes_the_row_and_a_row_argument_needs_a_default():
    assert check_reward("tests.rewards_with_row:difficulty", "5", "5") == 0.0  # an empty prompt, no column
    assert check_reward("tests.rewards_with_row:difficulty", "5", "5", row=Row("12", {"difficulty": 2})) == 2.002
    with pytest.raises(ValueError, match=r"must take \(completion, answer\), any other parameter with a default"):
        check_reward("tests.rewards_with_row:needs_prompt", "5", "5")


@pytest.mark.process  # the orchestrator's settings check the run's reward in a reward process
def test_a_task_carries_the_row_only_when_its_reward_takes_it(tiny_model_dir):
    from services.orchestrator.config import OrchestratorSettings
    from services.orchestrator.data import Tasks

    def made(reward: str):
        tasks = Tasks(
            OrchestratorSettings(
                model_path=str(tiny_model_dir), evals={"size": 5}, data={"train_size": 5}, reward=reward
            )
        )
        return tasks.train[0], tasks.make("t", tasks.train[0], 2, 1.0, False, 0)

    example, task = made("tests.rewards_with_row:difficulty")  # takes prompt and difficulty: arith has no difficulty
    assert json.loads(task.reward_row) == {"prompt": example.prompt, "columns": {}}
    example, task = made("tests.rewards_with_row:everything")  # **row: the arith rows' one column too
    assert json.loads(task.reward_row) == {"prompt": example.prompt, "columns": {"carries": example.columns["carries"]}}
    _, task = made("")  # the arith task's exact_match takes (completion, answer): nothing sent
    assert task.reward_row == ""


def test_a_parquet_column_that_is_no_json_value_is_refused_only_when_a_reward_takes_the_row(tmp_path):
    import datetime

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"problem": ["p0"], "answer": ["0"], "day": [datetime.date(2024, 1, 2)]}), path)
    assert MathTask(str(path)).split("train")[0].columns == {}  # a reward that takes no row: loaded as before
    with pytest.raises(ValueError, match=r"rows.parquet row 0: column 'day' holds a date; a reward gets JSON values"):
        MathTask(str(path), columns=True).split("train")


def test_a_row_a_reward_would_get_is_checked_before_any_process_starts(tmp_path):
    """`steadyrl run` (and --dry-run) refuse the data with exit 2, naming the file and row, instead of an
    orchestrator that dies on it after every service started."""
    from services.orchestrator.config import OrchestratorSettings
    from services.orchestrator.data import check_rows

    rows = [{"question": f"{i}+1=", "answer": str(i + 1), "difficulty": i % 3} for i in range(40)]
    bad = {
        "nan": '{"question": "1+1=", "answer": "2", "difficulty": NaN}',
        "deep": json.dumps({"question": "1+1=", "answer": "2", "difficulty": [[[[[0]]]]]}).replace(
            "[[[[[0]]]]]", "[" * 5000 + "0" + "]" * 5000
        ),
        "huge": json.dumps({"question": "1+1=", "answer": "2", "difficulty": 10**2000}),
        "surrogate": '{"question": "1+1=", "answer": "2", "difficulty": "\\ud800"}',
    }
    for name, line in bad.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[:7]) + line + "\n")
        path.write_text(path.read_text() + "".join(json.dumps(r) + "\n" for r in rows[7:]))
        for reward, refused in (("tests.rewards_with_row:difficulty", True), ("exact_match", False)):
            settings = OrchestratorSettings(
                model_path="tiny",
                reward=reward,
                data={"task": "math", "math_path": str(path), "prompt_column": "question", "answer_column": "answer"},
                evals={"size": 8},
            )
            if not refused and name in ("nan", "deep"):
                continue  # not JSON: the file is refused by any reward, see below
            if refused:
                with pytest.raises(ValueError, match=rf"{path}( line 8| row \d+)"):
                    check_rows(settings)
            else:
                check_rows(settings)  # a reward that reads no row: the large column is not its concern


def test_a_parameter_no_keyword_can_reach_is_refused_at_the_check():
    from shared.tasks.reward_runner import check_reward

    with pytest.raises(ValueError, match="prompt positional-only: the prompt and the row's columns come by keyword"):
        check_reward("tests.rewards_with_row:positional_prompt", "2", "2")
