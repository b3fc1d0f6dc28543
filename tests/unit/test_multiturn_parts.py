"""The small parts of multi-turn runs: the trainer's per-step trajectory diagnostics, the
orchestrator's multi-turn tasks and the settings that refuse a bad environment before any process
starts, a recipe with an agent turning the replicas' endpoint on, and the kit's calc traces."""

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.data import Tasks
from services.trainer.step_log import trajectory_metrics
from shared.envs.calc import MulTask
from shared.rollouts.record import Rollout
from steadyrl.recipe import load_recipe, section_values

ROOT = Path(__file__).resolve().parents[2]


def rollout(mask: list[bool], turns: int, finish: str = "done", **env) -> Rollout:
    n = len(mask)
    return Rollout(
        rollout_id="t:0",
        group_id="t",
        prompt_token_ids=np.array([1], dtype=np.int32),
        completion_token_ids=np.ones(n, dtype=np.int32),
        inference_logprobs=np.zeros(n, dtype=np.float32),
        policy_versions=np.zeros(n, dtype=np.uint64),
        reward=0.0,
        loss_mask=np.array(mask),
        turns=turns,
        finish_reason=finish,
        env_metrics=env,
    )


def test_trajectory_metrics_by_hand():
    a = rollout([True] * 4 + [False] * 2 + [True] * 2, 2, tool_calls=1.0, tool_success=1.0)
    b = rollout([True] * 3, 1, "max_tokens")
    single = Rollout(
        rollout_id="s:0",
        group_id="s",
        prompt_token_ids=np.array([1], dtype=np.int32),
        completion_token_ids=np.ones(5, dtype=np.int32),
        inference_logprobs=np.zeros(5, dtype=np.float32),
        policy_versions=np.zeros(5, dtype=np.uint64),
        reward=1.0,
    )
    assert trajectory_metrics([single]) == {}  # a single-turn step has none
    m = trajectory_metrics([a, b, single])
    assert m == pytest.approx(
        {
            "turns_mean": 1.5,
            "turn_tokens_mean": 9 / 3,
            "env_tokens_fraction": 2 / 11,
            "trajectories_done": 0.5,
            "env_tool_calls": 0.5,
            "env_tool_success": 0.5,
        }
    )


def settings(**fields) -> OrchestratorSettings:
    return OrchestratorSettings(**{"run_id": "r", "model_path": "tiny", **fields})


def test_multi_turn_tasks_carry_their_environment_budget_and_prompt_text(calc_model_dir):
    s = settings(
        model_path=str(calc_model_dir),
        data={"task": "calc"},
        trajectory={"max_turns": 3, "env_seconds": 5},
        sampling={"max_new_tokens": 14},
    )
    tasks = Tasks(s)
    task = tasks.make("train-0", tasks.train[0], 8, 1.0, False, 0)
    assert (task.environment, task.prompt_text, list(task.prompt_token_ids)) == ("calc", tasks.train[0].prompt, [])
    assert (task.budget.max_turns, task.budget.max_tokens, task.budget.env_seconds) == (3, 42, 5.0)
    assert task.task_name == "exact_match" and task.answer == tasks.train[0].answer
    single = Tasks(settings(model_path=str(calc_model_dir))).make("train-0", tasks.train[0], 8, 1.0, False, 0)
    assert single.environment == "" and list(single.prompt_token_ids) and not single.HasField("budget")
    agent = settings(
        model_path=str(calc_model_dir),
        data={"task": "calc"},
        trajectory={"environment": "agent:prog --x", "max_tokens": 30},
    )
    made = Tasks(agent).make("train-1", tasks.train[1], 8, 1.0, False, 0)
    assert (made.environment, made.budget.max_tokens) == ("agent:prog --x", 30)
    plugin = settings(
        model_path=str(calc_model_dir), data={"task": "calc"}, trajectory={"environment": "tests.envs:Echo"}
    )
    made = Tasks(plugin).make("train-2", tasks.train[2], 8, 1.0, False, 0)  # the calc rows, played by a plug-in
    assert (made.environment, made.prompt_text) == ("tests.envs:Echo", tasks.train[2].prompt)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"trajectory": {"environment": "nope"}}, "no environment named 'nope'"),
        ({"trajectory": {"environment": "tests.envs:Missing"}}, "cannot be imported"),
        ({"trajectory": {"environment": "agent:  "}}, "names its command"),
        ({"data": {"task": "verifiers"}}, "go together"),
        ({"trajectory": {"max_turns": 0}}, "max_turns"),
    ],
)
def test_a_bad_environment_is_refused_before_anything_starts(fields, message):
    with pytest.raises(ValidationError, match=message):
        settings(**fields)


def test_a_recipe_with_an_agent_turns_the_replicas_endpoint_on():
    plain = load_recipe(ROOT / "configs" / "tiny-tools.toml")
    agent = load_recipe(ROOT / "configs" / "tiny-tools.toml", ['orchestrator.trajectory.environment="agent:prog"'])
    assert plain.section_values("inference")["agent"]["endpoint"] is False
    assert agent.section_values("inference")["agent"]["endpoint"] is True
    forced = load_recipe(ROOT / "configs" / "tiny-tools.toml", ["inference.agent.endpoint=true"])
    assert forced.section_values("inference")["agent"]["endpoint"] is True
    played = {"orchestrator": {"trajectory": {"environment": "verifiers:x"}}}  # a package not installed here
    values = section_values(plain.run, plain.model, played, {}, "inference")
    assert values["agent"]["endpoint"] is True


def test_calc_traces_train_the_model_s_turns_alone(calc_model_dir):
    from shared.kit.tiny_tools import tool_trace
    from shared.models import load_tokenizer

    tokenizer = load_tokenizer(str(calc_model_dir))
    ids, labels = tool_trace(tokenizer, "37*46=", "1702")
    assert tokenizer.decode(ids) == "<s>37*46=:calc(37*46)</s>= 1702:1702</s>"
    trained = tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != -100])
    assert trained == "calc(37*46)</s>1702</s>"  # the prompt and the tool's answer are not trained
    direct_ids, direct_labels = tool_trace(tokenizer, "37*46=", "1702", use_tool=False)
    assert tokenizer.decode(direct_ids) == "<s>37*46=:1702</s>" and sum(x != -100 for x in direct_labels) == 5
    train = MulTask().split("train", 500)
    evals = MulTask().split("eval", 200)
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    assert all(int(e.answer) == eval(e.prompt.rstrip("=")) for e in train[:50])
