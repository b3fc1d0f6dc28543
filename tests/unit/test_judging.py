"""Model-judged rewards without a pool: reward names, templates, the verdict rules (each reading the
last number or word), a judge's reply checked before it becomes rewards, the rule reward riding on
the rollout, and the step's judge/rule agreement."""

import dataclasses
import math

import pytest
from pydantic import ValidationError

from services.inference.config import JudgeClientSettings, JudgeTemplate
from services.inference.judge import reply_problem, verdict_score
from services.orchestrator.config import checked_reward
from services.trainer.step_log import reward_metrics
from shared.rollouts.record import RolloutError, decode_rollout, encode_rollout, validate_rollout
from shared.rpc.steadyrl.v1 import inference_pb2 as pb
from shared.tasks.judging import (
    VerdictError,
    check_template,
    is_model_reward,
    model_reward,
    parse_verdict,
    render,
)
from shared.tasks.reward_runner import Score
from tests.unit.test_group_buffer import rollout


def test_reward_names_and_templates():
    assert model_reward("judge:arith") == ("judge", "arith")
    assert model_reward("reward_model:helpful_2") == ("reward_model", "helpful_2")
    assert model_reward("exact_match") is None and model_reward("pkg.mod:fn") is None
    assert is_model_reward("judge:arith") and not is_model_reward("exact_match")
    with pytest.raises(ValueError, match="judge:NAME or reward_model:NAME"):
        is_model_reward("judge:Arith")
    with pytest.raises(ValueError, match="judge:NAME or reward_model:NAME"):
        checked_reward("reward_model:")
    assert checked_reward("judge:arith") == "judge:arith"  # the templates are the launcher's and the replica's check
    assert render("{prompt}{response}? ({answer})", "07+35=", "240", "240") == "07+35=240? (240)"
    with pytest.raises(ValueError, match=r"names \['reply'\]"):
        check_template("{prompt} {reply}")
    with pytest.raises(ValueError, match="must name {response}"):
        check_template("{prompt} {answer}")
    with pytest.raises(ValueError, match="judge template"):
        check_template("{response")


def test_each_rule_reads_the_last_number_or_word():
    assert parse_verdict("score 3 of 10, final: 7.5", "number", {}) == 7.5
    assert parse_verdict("-2e-1", "number", {}) == pytest.approx(-0.2)
    assert parse_verdict("240 y", "yes_no", {}) == 1.0
    assert parse_verdict("It is wrong.\nVerdict: NO", "yes_no", {}) == 0.0
    labels = {"good": 1.0, "ok": 0.5, "bad": 0.0}
    assert parse_verdict("mostly fine. label: ok", "label", labels) == 0.5
    for text, rule, reason in [
        ("no digits here", "number", "verdict:no_number"),
        ("maybe", "yes_no", "verdict:not_yes_no"),
        ("?!", "yes_no", "verdict:empty"),
        ("great", "label", "verdict:unknown_label"),
    ]:
        with pytest.raises(VerdictError) as error:
            parse_verdict(text, rule, labels)
        assert error.value.reason == reason
    template = JudgeTemplate(prompt="{response}", rule="yes_no")
    assert verdict_score(pb.JudgeVerdict(text="240 n"), "judge", template) == Score(0.0)
    assert verdict_score(pb.JudgeVerdict(text="240"), "judge", template) == Score(0.0, "verdict:not_yes_no")
    assert verdict_score(pb.JudgeVerdict(score=0.25), "reward_model", template) == Score(0.25)


def test_templates_are_checked_where_they_are_declared():
    with pytest.raises(ValidationError, match="rule 'label' needs labels"):
        JudgeTemplate(prompt="{response}", rule="label")
    with pytest.raises(ValidationError, match=r"labels \['Good'\]"):
        JudgeTemplate(prompt="{response}", rule="label", labels={"Good": 1.0})
    with pytest.raises(ValidationError, match="no reward named 'exact'"):
        JudgeTemplate(prompt="{response}", compare_with="exact")
    with pytest.raises(ValidationError, match=r"template names \['Arith'\]"):
        JudgeClientSettings(templates={"Arith": {"prompt": "{response}"}})


def test_a_judge_reply_is_checked_before_it_becomes_rewards():
    texts = pb.JudgeReply(verdicts=[pb.JudgeVerdict(text="1 y"), pb.JudgeVerdict(text="2 n")])
    assert reply_problem(texts, 2, "judge") == ""
    assert reply_problem(texts, 3, "judge") == "2 verdicts for 3 texts"
    assert "no finite score" in reply_problem(texts, 2, "reward_model")
    scalars = pb.JudgeReply(verdicts=[pb.JudgeVerdict(score=0.5), pb.JudgeVerdict(score=math.nan)])
    assert reply_problem(scalars, 2, "reward_model") == "verdict 1: no finite score from a reward model"
    assert "serves a reward model" in reply_problem(scalars, 2, "judge")


def test_the_rule_reward_rides_on_the_rollout_and_gives_the_agreement():
    plain = rollout("t1", 0)
    assert decode_rollout(encode_rollout(plain)).reference_reward is None
    judged = dataclasses.replace(plain, reward=1.0, reference_reward=0.0)
    assert decode_rollout(encode_rollout(judged)).reference_reward == 0.0
    with pytest.raises(RolloutError, match="reference_reward is nan"):
        validate_rollout(dataclasses.replace(plain, reference_reward=math.nan))
    rollouts = [
        dataclasses.replace(plain, reward=r, reference_reward=e)
        for r, e in [(1.0, 1.0), (1.0, 0.0), (0.0, 0.0), (0.0, 0.0), (0.9, 1.0)]
    ]
    metrics = reward_metrics([*rollouts, plain])  # a rollout without a comparison is left out
    assert metrics["judge_agreement"] == pytest.approx(4 / 5)
    assert metrics["judge_reference_reward_mean"] == pytest.approx(2 / 5)
    assert "judge_agreement" not in reward_metrics([plain])


def test_a_judged_run_scores_its_evals_with_the_rule_it_names(tiny_model_dir):
    from services.orchestrator.config import OrchestratorSettings
    from services.orchestrator.data import Tasks

    settings = OrchestratorSettings(
        run_id="r",
        model_path=str(tiny_model_dir),
        reward="judge:arith",
        evals={"size": 5, "reward": "exact_match"},
        data={"train_size": 7},
    )
    tasks = Tasks(settings)
    example = tasks.train[0]
    assert tasks.make("train-0", example, 4, 1.0, False, 0).task_name == "judge:arith"
    assert tasks.make("eval-0", example, 1, 0.0, True, 0).task_name == "exact_match"
    plain = Tasks(settings.model_copy(update={"evals": settings.evals.model_copy(update={"reward": ""})}))
    assert plain.make("eval-0", example, 1, 0.0, True, 0).task_name == "judge:arith"  # unset: the training reward
    with pytest.raises(ValidationError, match="no reward named 'exact'"):
        OrchestratorSettings(run_id="r", model_path="tiny", evals={"reward": "exact"})
