"""Data mixtures: the task → (source, example) plan by hand, the tasks each source makes, the settings
that refuse a bad mixture, `source` on the wire and the trainer's per-source metrics."""

import numpy as np
import pytest
from pydantic import ValidationError

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.data import Tasks
from services.orchestrator.mixture import MixturePlan, quotas
from services.trainer.step_log import reward_metrics
from shared.rollouts.record import Rollout, RolloutError, decode_rollout, encode_rollout, validate_rollout
from shared.rpc.steadyrl.v1 import common_pb2

ADD = {"name": "add", "task": "arith", "weight": 3, "train_size": 10}
TRACE = {"name": "trace", "task": "mul_trace", "weight": 1, "train_size": 4}


def settings(**fields) -> OrchestratorSettings:
    return OrchestratorSettings(**{"run_id": "r", "model_path": "tiny", "evals": {"size": 5}, **fields})


def test_quotas_round_by_largest_remainder():
    assert quotas([3, 1]) == [750, 250]
    assert quotas([1, 2]) == [333, 667]  # 333.33 and 666.67: the larger remainder gets the spare task
    assert quotas([1, 1, 1]) == [334, 333, 333]  # equal remainders: the earlier source
    assert quotas([1, 1, 2], cycle=4) == [1, 1, 2]


def test_the_plan_interleaves_by_smooth_weighted_round_robin():
    # 3:1 — credits (+750, +250, pick the larger, it pays 1000): A A B A, then again
    three_to_one = MixturePlan([3, 1])
    assert [three_to_one.task(i) for i in range(8)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (0, 2),
        (0, 3),
        (0, 4),
        (1, 1),
        (0, 5),
    ]
    # 1:1:2 — C A B C, then again
    assert [MixturePlan([1, 1, 2]).task(i)[0] for i in range(8)] == [2, 0, 1, 2, 2, 0, 1, 2]
    # a later cycle: task 1000 + 2 is the 250 + 0-th of source 1
    assert three_to_one.task(1002) == (1, 250)
    assert three_to_one.drawn(0, 8) == 6 and three_to_one.drawn(1, 1003) == 251


def test_every_window_holds_close_to_its_share():
    plan = MixturePlan([5, 3, 1, 1])
    sources = [plan.task(i)[0] for i in range(2500)]  # across cycle boundaries
    for width in (10, 40, 137):
        for start in range(0, 2500 - width, 7):
            window = sources[start : start + width]
            for source, quota in enumerate(plan.quotas):
                assert abs(window.count(source) - width * quota / plan.cycle) < 2


def test_train_task_is_the_same_alone_or_in_sequence(tiny_model_dir):
    s = settings(model_path=str(tiny_model_dir), data={"mixture": [ADD, TRACE]})
    tasks = Tasks(s)
    drawn = {"add": 0, "trace": 0}
    walked = []
    for i in range(2100):
        source, example = tasks.train_task(i)
        own = tasks.sources[source].train
        assert example == own[drawn[source] % len(own)]  # its k-th occurrence, cycled over its examples
        drawn[source] += 1
        walked.append((source, example))
    assert drawn == {"add": 1575, "trace": 525}  # 2 cycles of 750 + 250, then 100 tasks: 75 + 25
    fresh = Tasks(s)
    for i in (2099, 1000, 7, 1234, 0):  # alone, out of order, on another Tasks
        assert fresh.train_task(i) == walked[i]
    # epoch: whole passes over every source; 14 tasks (AABA ×3, AA) draw add 11 of 10, trace 3 of 4
    assert (tasks.epoch(0), tasks.epoch(14), tasks.epoch(15)) == (0, 0, 1)
    assert tasks.epoch(2100) == 131  # add: 1575 // 10 = 157, trace: 525 // 4 = 131


def test_a_single_source_maps_task_i_to_train_i_mod_its_size(tiny_model_dir):
    tasks = Tasks(settings(model_path=str(tiny_model_dir), data={"train_size": 7}))
    assert [tasks.train_task(i) for i in (0, 6, 7, 1003)] == [("", tasks.train[i % 7]) for i in (0, 6, 7, 1003)]
    assert tasks.epoch(20) == 20 // 7 and list(tasks.evals) == ["main"]
    made = tasks.make_train(3, 0)
    assert (made.task_id, made.source, made.answer) == ("train-3", "", tasks.train[3].answer)


def test_each_source_makes_its_tasks_with_its_reward_and_environment(tiny_model_dir):
    calc = {"name": "calc", "task": "calc", "train_size": 6}
    tasks = Tasks(settings(model_path=str(tiny_model_dir), data={"mixture": [ADD, TRACE, calc]}))
    made = {}
    for i in range(10):
        task = tasks.make_train(i, 0)
        made.setdefault(task.source, task)
        assert task.task_id == f"train-{i}" and task.answer == tasks.train_task(i)[1].answer
    assert set(made) == {"add", "trace", "calc"}
    assert made["add"].environment == "" and list(made["add"].prompt_token_ids)
    assert made["trace"].environment == "" and made["trace"].task_name == "exact_match"
    assert made["calc"].environment == "calc" and made["calc"].prompt_text and not made["calc"].prompt_token_ids
    # evals: each source's split by its name, `main` their union, every problem tagged with its source
    assert list(tasks.evals) == ["main", "add", "trace", "calc"]
    assert tasks.evals["main"] == tasks.evals["add"] + tasks.evals["trace"] + tasks.evals["calc"]
    assert {source for source, _ in tasks.evals["trace"]} == {"trace"} and len(tasks.evals["trace"]) == 5
    source, example = tasks.evals["calc"][0]
    evaluated = tasks.make("eval.calc-0-0", example, 1, 0.0, True, 0, source)
    assert (evaluated.source, evaluated.environment, evaluated.is_eval) == ("calc", "calc", True)


def test_a_math_source_is_scored_by_math_verify_unless_the_run_names_a_reward(tmp_path, tiny_model_dir):
    import json

    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) for i in range(12)))
    math = {"name": "gsm", "task": "math", "math_path": str(path), "weight": 1}
    own = Tasks(settings(model_path=str(tiny_model_dir), data={"mixture": [ADD, math]}))
    assert {n: s.reward for n, s in own.sources.items()} == {"add": "exact_match", "gsm": "math_verify"}
    assert len(own.sources["gsm"].train) == 7 and len(own.evals["gsm"]) == 5  # the last evals.size held out
    forced = Tasks(settings(model_path=str(tiny_model_dir), reward="exact_match", data={"mixture": [ADD, math]}))
    assert {s.reward for s in forced.sources.values()} == {"exact_match"}


def test_one_sources_eval_problem_trained_by_another_is_refused(tmp_path, tiny_model_dir):
    import json

    def write(name: str, problems: list[str]) -> str:
        (tmp_path / name).write_text("\n".join(json.dumps({"problem": p, "answer": "1"}) for p in problems))
        return str(tmp_path / name)

    first = {
        "name": "a",
        "task": "math",
        "math_path": write("a.jsonl", ["p0", "p1"]),
        "math_eval_path": write("ae.jsonl", ["q"]),
    }
    second = {
        "name": "b",
        "task": "math",
        "math_path": write("b.jsonl", ["r"]),
        "math_eval_path": write("be.jsonl", ["p1"]),
    }
    with pytest.raises(ValueError, match="1 eval problems of source 'b' are also training problems"):
        Tasks(settings(model_path=str(tiny_model_dir), data={"mixture": [first, second]}))
    allowed = Tasks(
        settings(model_path=str(tiny_model_dir), data={"mixture": [first, {**second, "allow_eval_overlap": True}]})
    )
    assert [e.prompt.split("\n")[0] for _, e in allowed.evals["b"]] == ["p1"]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"mixture": [ADD, {**TRACE, "name": "add"}]}, "names must be unique: \\['add'\\]"),
        ({"mixture": [ADD, {**TRACE, "weight": 0}]}, "greater than 0"),
        ({"mixture": [ADD, {**TRACE, "weight": 1e-4}]}, "\\['trace'\\] weigh too little to draw one task in 1000"),
        ({"mixture": [ADD, {**TRACE, "task": "verifiers"}]}, "task 'verifiers' cannot be a mixture source"),
        ({"mixture": [ADD, {**TRACE, "mixture": [ADD]}]}, "a mixture source cannot have a mixture of its own"),
        ({"mixture": [ADD, {**TRACE, "name": "main"}]}, "not 'main'"),
        ({"mixture": [ADD, {**TRACE, "name": "Trace-1"}]}, "lower-case letters, digits and _"),
        ({"mixture": [ADD, {**TRACE, "task": "math"}]}, "data.task 'math' needs data.math_path"),
        ({"task": "mul_trace", "mixture": [ADD]}, "data.task set beside data.mixture"),
    ],
)
def test_a_bad_mixture_is_refused_by_the_settings(data, message):
    with pytest.raises(ValidationError, match=message):
        settings(data=data)


def test_a_mixture_source_and_an_eval_set_cannot_share_a_name(tmp_path):
    with pytest.raises(ValidationError, match="both a mixture source and an evals.sets name"):
        settings(data={"mixture": [ADD, TRACE]}, evals={"sets": {"trace": tmp_path / "t.jsonl"}})


def test_check_dataset_checks_every_sources_files(tmp_path):
    gone = {"name": "gone", "task": "math", "math_path": str(tmp_path / "gone.jsonl")}
    with pytest.raises(ValueError, match="gone.jsonl"):
        settings(data={"mixture": [ADD, gone]}).check_dataset()


def rollout(reward: float, source: str = "", error: str = "") -> Rollout:
    return Rollout(
        rollout_id=f"t{reward}:0",
        group_id="t",
        prompt_token_ids=np.array([1], dtype=np.int32),
        completion_token_ids=np.array([2, 3], dtype=np.int32),
        inference_logprobs=np.array([-0.5, -0.25], dtype=np.float32),
        policy_versions=np.array([0, 0], dtype=np.uint64),
        reward=reward,
        reward_error=error,
        source=source,
    )


def test_source_travels_on_the_wire_and_a_bad_one_is_refused():
    sent = rollout(1.0, "gsm8k_2")
    assert decode_rollout(encode_rollout(sent)).source == "gsm8k_2"
    assert common_pb2.PromptTask.FromString(common_pb2.PromptTask(source="add").SerializeToString()).source == "add"
    validate_rollout(decode_rollout(encode_rollout(sent)))
    for bad in ("x" * 65, "Bad name"):
        with pytest.raises(RolloutError) as err:
            validate_rollout(decode_rollout(encode_rollout(rollout(1.0, bad))))
        assert err.value.reason == "source"


def test_replicas_copy_the_tasks_source_onto_every_rollout():
    from services.inference.trajectories import encode_trajectories
    from shared.engines import Sample
    from shared.envs.trajectory import Trajectory
    from shared.rollouts.record import RolloutTimings
    from shared.rollouts.samples import encode_samples, rollouts_from_samples

    task = common_pb2.PromptTask(task_id="train-4", run_id="r", prompt_token_ids=[1, 2], source="trace")
    samples = [Sample(token_ids=[3], logprobs=[-0.1], versions=[0], finish_reason="stop")] * 2
    timings = RolloutTimings()
    assert {r.source for r in rollouts_from_samples(task, samples, [1.0, 0.0], "inf-0", "torch", timings)} == {"trace"}
    encoded = encode_samples(task, samples, [1.0, 0.0], "inf-0", "torch", timings)
    played = Trajectory(prompt_token_ids=[1, 2], token_ids=[3], loss_mask=[True], logprobs=[-0.1], versions=[0])
    encoded += encode_trajectories(task, [played], "inf-0", "torch", timings)
    assert [decode_rollout(data).source for data in encoded] == ["trace"] * 3


def test_per_source_metrics_by_hand():
    step = [rollout(1.0, "add"), rollout(0.0, "add"), rollout(0.5, "add"), rollout(0.25, "trace", "error:X")]
    assert reward_metrics(step) == pytest.approx(
        {
            "reward_failures": 0.25,
            "source/add/reward_mean": 0.5,  # (1 + 0 + 0.5) / 3
            "source/add/rollouts": 3,
            "source/trace/reward_mean": 0.0,  # its one reward failed: no reward scored (left out of the loss)
            "source/trace/rollouts": 1,
        }
    )
    assert reward_metrics([rollout(1.0), rollout(0.0)]) == {"reward_failures": 0.0}  # one source: nothing new
