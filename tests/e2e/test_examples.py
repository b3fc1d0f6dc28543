"""The worked examples in examples/, each on the tiny model, from the `steadyrl run` line of its
README: every recipe passes the checks `steadyrl run` makes before it starts anything; the own
model and dataset train in a whole run (its Redis read back from the AOF: the eval rollouts are
the rows of eval.jsonl, the trained ones of train tasks made of train.jsonl); the custom reward,
the tool environment, the agent program and the verifiers environment play tasks made from their
recipes through a real replica (its reward process, its OpenAI endpoint, bubblewrap), and their
rollouts carry what each example computes."""

import asyncio
import json
import operator
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis

from services.orchestrator.data import Tasks
from shared.models import decode_completions, load_tokenizer
from shared.rollouts.record import decode_rollout, validate_rollout
from shared.runstore.keys import RunKeys
from shared.runstore.ledger import Ledger
from shared.runstore.queues import WorkQueue
from shared.runstore.redis_server import RedisServer
from shared.tasks import MathTask
from steadyrl.recipe import load_recipe
from steadyrl.service_settings import check
from tests.helpers import submit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("custom-reward", "own-model-and-data", "tool-environment", "agent-program", "verifiers-environment")
RUN_LINE = re.compile(r"^(?:PYTHONPATH=(\S+) )?\.venv/bin/steadyrl run (.+)$", re.MULTILINE)
SMALL = ["run.steps=2", "run.batch_prompts=4", "run.group_size=4", "orchestrator.evals.every=2"]
CALLED = re.compile(r"calc\((\d+)([-+*])(\d+)\)</s>= (-?\d+)")  # a call and the tool's answer, as rendered
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def run_line(example: str) -> tuple[str, list[str]]:
    """(PYTHONPATH, recipe files) of the one `steadyrl run` line in the example's README."""
    [(path, recipes)] = RUN_LINE.findall((ROOT / "examples" / example / "README.md").read_text())
    return path, recipes.split()


def settings_of(example: str, monkeypatch) -> dict:
    """Every service's settings of the example's recipe as `steadyrl run` checks them (the model
    path a placeholder), its PYTHONPATH applied here (the plug-ins import in this process) and for
    the processes this one starts (reward processes)."""
    path, recipes = run_line(example)
    if path:
        monkeypatch.syspath_prepend(str(ROOT / path))
        monkeypatch.setenv("PYTHONPATH", str(ROOT / path))
    return check(load_recipe([ROOT / r for r in recipes]))


def tasks_of(example: str, monkeypatch, model_dir) -> Tasks:
    """The example's prompts as its run's orchestrator makes them, on `model_dir`."""
    orchestrator = settings_of(example, monkeypatch)["orchestrator"]
    return Tasks(orchestrator.model_copy(update={"model_path": str(model_dir)}))


@pytest.mark.process  # the reward check runs a reward process
@pytest.mark.parametrize("example", EXAMPLES)
def test_each_example_documents_a_recipe_that_passes_the_checks(example, monkeypatch):
    path, recipes = run_line(example)
    recipe = ROOT / "examples" / example / "recipe.toml"
    assert recipes[-1] == f"examples/{example}/recipe.toml" and all((ROOT / r).is_file() for r in recipes)
    assert path in ("", f"examples/{example}")
    line = f"{'PYTHONPATH=' + path + ' ' if path else ''}.venv/bin/steadyrl run {' '.join(recipes)}"
    assert line in recipe.read_text(), "the recipe's header gives the README's command"
    monkeypatch.chdir(ROOT)  # the recipes' paths are relative to the repository's root
    settings = settings_of(example, monkeypatch)
    assert settings["orchestrator"].run_id == example and settings["orchestrator"].steps > 0


@pytest.mark.e2e
@pytest.mark.process
def test_own_model_and_data_train_in_a_whole_run(tmp_path, monkeypatch):
    model_dir = tmp_path / "own-model"
    monkeypatch.setattr(sys, "argv", ["make_model.py", str(model_dir)])
    runpy.run_path(str(ROOT / "examples" / "own-model-and-data" / "make_model.py"), run_name="__main__")
    _, recipes = run_line("own-model-and-data")
    out = tmp_path / "run"
    sets = [*SMALL, f'model.path="{model_dir}"']
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            *recipes,
            "--out",
            str(out),
            *[a for s in sets for a in ("--set", s)],
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == 2, summary
    config = json.loads((out / "final-model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == 100  # the script's model

    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["prompts"]) for e in evals] == [(0, 16), (2, 16)], evals  # every row of eval.jsonl

    data = ROOT / "examples" / "own-model-and-data"
    template = MathTask("").template  # the math task's wording of a row
    rows = {name: [json.loads(line) for line in (data / name).open()] for name in ("train.jsonl", "eval.jsonl")}
    with RedisServer(out / "redis", appendonly=True) as redis:  # the run's Redis, from its AOF
        trained, scored = asyncio.run(read_run(redis.url, "own-model-and-data"))
    # the trainer's ledger: 2 steps × 4 prompts × 4 samples, of train tasks (train-N: the N-th train row)
    assert len(set(trained)) == 2 * 4 * 4 and all(re.fullmatch(r"train-\d+:[0-3]", i) for i in trained), trained
    # the eval rounds' rollouts stay in Redis: the rows of eval.jsonl, read by the script's tokenizer
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.decode(r.prompt_token_ids.tolist(), skip_special_tokens=True) for r in scored]
    assert sorted(prompts) == sorted([template.format(problem=row["question"]) for row in rows["eval.jsonl"]] * 2)
    assert all(r.reward_error == "" for r in scored)  # math_verify scored every one
    # and the train tasks were made of train.jsonl's rows, in order (the orchestrator's own code)
    monkeypatch.chdir(ROOT)
    made = [e.prompt for e in tasks_of("own-model-and-data", monkeypatch, model_dir).train]
    assert made == [template.format(problem=row["question"]) for row in rows["train.jsonl"]]


async def read_run(url: str, run_id: str) -> tuple[list[str], list]:
    """(the rollout ids trained, the eval rounds' rollouts) of a finished run."""
    redis = Redis.from_url(url)
    trained = await Ledger(redis, run_id).trained()
    entries = await redis.xrange(RunKeys(run_id).evals)
    await redis.aclose()
    return trained, [decode_rollout(f[b"r"]) for _, f in entries]


def play(tmp_path, model_dir, redis_url, run_id, tasks: dict, replica: dict | None = None) -> dict:
    """Every task of `tasks` (task id → PromptTask) played by one replica: rollout id → Rollout."""
    from tests.integration.test_inference import Replica, _completed, wait_for

    async def main():
        redis = Redis.from_url(redis_url)
        queue = WorkQueue(redis, run_id)
        async with Replica(tmp_path, model_dir, redis_url, run_id, **(replica or {})):
            for task in tasks.values():
                task.run_id = run_id
                assert await submit(queue, task)
            await wait_for(lambda: _completed(queue, len(tasks)), 180)
            entries = await redis.xrange(queue.rollout_stream)
            dead = await queue.dead_counts()
        await redis.aclose()
        return entries, dead

    entries, dead = asyncio.run(asyncio.wait_for(main(), 240))
    assert not dead, dead
    rollouts = {r.rollout_id: r for r in (decode_rollout(f[b"r"]) for _, f in entries)}
    assert {i.split(":")[0] for i in rollouts} == set(tasks)
    for r in rollouts.values():
        validate_rollout(r)
    return rollouts


def made(tasks: Tasks, prefix: str, count: int, group_size: int) -> dict:
    """`count` train tasks of a recipe, made as its orchestrator makes them (seeded: a replayable draw)."""
    out = {}
    for i in range(count):
        task = tasks.make(f"{prefix}-{i}", tasks.train[i], group_size, 1.0, False, 0)
        task.sampling.seed = 1000 * (i + 1)  # sample j of the group draws with seed + j
        out[task.task_id] = task
    return out


def test_the_custom_reward_scores_a_replicas_rollouts(tmp_path, tiny_model_dir, redis_server, run_id, monkeypatch):
    tasks = made(tasks_of("custom-reward", monkeypatch, tiny_model_dir), "reward", 4, 8)
    assert {t.task_name for t in tasks.values()} == {"reward:score"}
    from reward import score  # examples/custom-reward/reward.py, on the path as the README puts it

    # its credit for 2 of 3 digits in place: 0.5 × 2/3 × (1 + carries) / (1 + the prompt's width of 2)
    assert [score("241", "240", prompt="17+25=", carries=c) for c in (0, 1, 2)] == pytest.approx([1 / 9, 2 / 9, 1 / 3])
    assert score("241", "240") == pytest.approx(1 / 3) and score("240", "240", prompt="17+25=") == 1.0
    # each task carries the reward's two arguments of its row: its prompt and its carries, nothing else
    rows = {i: json.loads(t.reward_row) for i, t in tasks.items()}
    for row in rows.values():
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        assert row["columns"] == {"carries": sum((a % 10**k + b % 10**k) >= 10**k for k in (1, 2))}
    assert len({row["columns"]["carries"] for row in rows.values()}) > 1, rows  # problems of more than one difficulty

    declared = settings_of("custom-reward", monkeypatch)["inference"].plugins  # what its recipe gives the replicas
    assert declared == ["reward:score"]
    rollouts = play(tmp_path, tiny_model_dir, redis_server.url, run_id, tasks, {"plugins": declared})
    tokenizer = load_tokenizer(tiny_model_dir)
    without_row = []  # what the rewards would have been had the row not reached the reward process
    for r in rollouts.values():
        [text] = decode_completions(tokenizer, [r.completion_token_ids.tolist()])
        row = rows[r.task_id]
        want = score(text, tasks[r.task_id].answer, prompt=row["prompt"], carries=row["columns"]["carries"])
        assert r.reward_error == "" and r.reward == pytest.approx(want)
        without_row.append(score(text, tasks[r.task_id].answer))
    rewards = [r.reward for r in rollouts.values()]
    assert rewards != pytest.approx(without_row)  # the replica's reward process got the row
    assert any(0 < x < 1 for x in rewards), rewards  # partial credit: no built-in reward gives it


def test_the_multi_turn_examples_play_through_a_replica(tmp_path, calc_model_dir, redis_server, run_id, monkeypatch):
    monkeypatch.chdir(ROOT)  # the agent's command names its script from the repository's root
    tasks = {
        **made(tasks_of("tool-environment", monkeypatch, calc_model_dir), "tool", 3, 8),
        **made(tasks_of("agent-program", monkeypatch, calc_model_dir), "agent", 3, 8),
        **made(tasks_of("verifiers-environment", monkeypatch, calc_model_dir), "vf", 3, 8),
    }
    assert {t.environment for t in tasks.values()} == {
        "calculator_env:make",
        "agent:python3 examples/agent-program/agent.py",
        "verifiers:vf_multiply",
    }
    declared = sorted(  # what each example's recipe gives its replicas
        p
        for e in ("tool-environment", "agent-program", "verifiers-environment")
        for p in settings_of(e, monkeypatch)["inference"].plugins
    )
    assert declared == sorted({t.environment for t in tasks.values()})
    rollouts = play(
        tmp_path, calc_model_dir, redis_server.url, run_id, tasks, {"agent": {"endpoint": True}, "plugins": declared}
    )
    tokenizer = load_tokenizer(calc_model_dir)
    played: dict[str, list] = {}  # example → (rollout, tool calls answered, final answer right) per trajectory
    for r in rollouts.values():
        text = tokenizer.decode(r.completion_token_ids.tolist(), skip_special_tokens=False)
        calls = CALLED.findall(text)
        assert all(OPERATIONS[op](int(a), int(b)) == int(result) for a, op, b, result in calls), text
        assert not calls or not r.model_tokens.all()  # a tool's answer is in the record, out of the loss
        final = text.split(":")[-1].replace("</s>", "").strip()
        played.setdefault(r.task_id.split("-")[0], []).append((r, len(calls), final == tasks[r.task_id].answer))

    tool = played["tool"]  # the example's environment played them: its own counts, the tool answered
    assert all("tool_success" not in r.env_metrics for r, _, _ in tool)  # the built-in calc's count
    assert any("solved_with_tool" in r.env_metrics for r, _, _ in tool)
    assert sum(r.env_metrics.get("tool_calls", 0) for r, _, _ in tool) >= sum(c for _, c, _ in tool) >= 1
    assert all(r.reward == right for r, _, right in tool if r.finish_reason == "done")

    agent = played["agent"]  # every model turn was a request of the program to the endpoint
    assert all(r.env_metrics["model_calls"] == r.turns >= 1 for r, _, _ in agent)
    assert sum(c for _, c, _ in agent) >= 1 and all(r.reward == right for r, _, right in agent)

    vf = played["vf"]  # the environment's rubric scored them: its reward, and its weight-0 metric
    assert all(r.reward == r.env_metrics["correct"] == right for r, _, right in vf)
    assert all(r.env_metrics["used_calc"] == 1 for r, c, _ in vf if c) and sum(c for _, c, _ in vf) >= 1
