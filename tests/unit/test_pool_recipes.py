"""A recipe's [teacher] and [judge] pools: validated before anything starts (a judged reward with its
pool and template, a pool with a reward that uses it), and `steadyrl run`'s plan starts their replicas
(pool `teacher` / `judge`, the pool's model) and gives their addresses to the rollout replicas alone
(π's eval replica and the trainer never call them)."""

import json
from pathlib import Path

import pytest

from services.inference.config import InferenceSettings
from steadyrl.processes import Launch
from steadyrl.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "tiny-arith.toml"
JUDGED = ROOT / "configs" / "tiny-judge.toml"
DISTILLED = ROOT / "configs" / "tiny-distill.toml"


def test_the_teacher_section_is_validated_with_its_name():
    distils = "trainer.distill.coef=1.0"
    config = load_recipe(RECIPE, ['teacher.path="/models/teacher"', "teacher.replicas=2", distils])
    assert config.teacher.path == "/models/teacher" and config.teacher.replicas == 2
    assert '[teacher]\npath = "/models/teacher"' in config.as_toml()
    assert load_recipe(RECIPE).teacher is None
    with pytest.raises(ValueError, match=r"(?s)\[teacher\].*pth"):
        load_recipe(RECIPE, ['teacher.path="/m"', 'teacher.pth="/m"', distils])
    with pytest.raises(ValueError, match=r"(?s)\[teacher\].*replicas"):
        load_recipe(RECIPE, ['teacher.path="/m"', "teacher.replicas=0", distils])
    # a teacher pool needs a distillation that reads it, and a distillation its teacher pool
    with pytest.raises(ValueError, match=r"\[teacher\] starts a teacher pool that nothing reads"):
        load_recipe(RECIPE, ['teacher.path="/m"'])
    for setting in (distils, "trainer.distill.top_k=4"):
        with pytest.raises(ValueError, match=r"\[trainer.distill\] needs a teacher pool: add \[teacher\]"):
            load_recipe(RECIPE, [setting])


def test_the_distillation_recipe_names_the_kit_teacher_and_each_pool_takes_its_own_kit_model():
    config = load_recipe(DISTILLED)
    assert config.teacher.path == "tiny-teacher" and config.judge is None
    assert config.section("trainer")["distill"] == {"top_k": 8, "top_k_coef": 1.0, "coef": 0.0, "reward_weight": 0.0}
    assert config.section("orchestrator")["data"]["arith_fixed_width"] is False  # the teacher's format
    assert config.section("trainer")["mini_batches"] == 8 and config.run.steps == 2000
    with pytest.raises(ValueError, match=r"\[teacher\] path = 'tiny-judge' is the kit's judge: a teacher pool takes"):
        load_recipe(DISTILLED, ['teacher.path="tiny-judge"'])
    with pytest.raises(ValueError, match=r"\[judge\] path = 'tiny-teacher' is the kit's teacher: a judge pool takes"):
        load_recipe(JUDGED, ['judge.path="tiny-teacher"'])


def test_the_plan_starts_the_pool_and_points_the_rollout_replicas_at_it(tmp_path):
    overrides = ['teacher.path="/models/teacher"', "teacher.replicas=2", "run.replicas=2", "trainer.distill.top_k=5"]
    overrides.append("orchestrator.evals.policy=true")
    launch = Launch(load_recipe(RECIPE, overrides), tmp_path, "model", gpus_available=0)
    try:
        launch.plan("redis://127.0.0.1:1")
        by_name = {s.name: s for s in launch.services}
    finally:
        launch.ports.close()
    teachers = [by_name["teacher-0"], by_name["teacher-1"]]
    assert [t.env["STEADYRL_INFERENCE_POOL"] for t in teachers] == ["teacher", "teacher"]
    assert {t.env["STEADYRL_INFERENCE_MODEL_PATH"] for t in teachers} == {"/models/teacher"}
    assert "STEADYRL_INFERENCE_WEIGHTSYNC_ADDRESS" not in teachers[0].env  # fixed weights
    addresses = [f"127.0.0.1:{t.grpc_port}" for t in teachers]
    for name in ("inference-0", "inference-1"):
        assert json.loads(by_name[name].env["STEADYRL_INFERENCE_TEACHER__ADDRESSES"]) == addresses
        assert by_name[name].env["STEADYRL_INFERENCE_TEACHER__TOP_K"] == "5"  # what the trainer's loss reads
    assert "STEADYRL_INFERENCE_TEACHER__ADDRESSES" not in by_name["inference-policy"].env
    assert launch.inference_replicas() == 3  # the pool is not a rollout replica


def test_a_judged_reward_needs_its_pool_and_template_and_a_pool_needs_a_reward():
    config = load_recipe(JUDGED)
    assert config.judge.path == "tiny-judge" and '[judge]\npath = "tiny-judge"' in config.as_toml()
    with pytest.raises(ValueError, match=r"'judge:arith' needs a judge pool: add \[judge\]"):
        load_recipe(RECIPE, ['orchestrator.reward="judge:arith"'])
    with pytest.raises(ValueError, match=r"names the template 'other'.*\[inference.judge.templates.other\]"):
        load_recipe(JUDGED, ['orchestrator.reward="judge:other"'])
    with pytest.raises(ValueError, match=r"\[judge\] starts a judge pool that no reward uses"):
        load_recipe(RECIPE, ['judge.path="/models/judge"'])
    with pytest.raises(ValueError, match="tiny-judge writes verdicts"):
        load_recipe(JUDGED, ['orchestrator.reward="reward_model:arith"'])
    with pytest.raises(ValueError, match=r"(?s)\[judge\].*replicas"):
        load_recipe(JUDGED, ["judge.replicas=0"])


def test_the_plan_starts_the_judge_pool_beside_the_teacher_pool(tmp_path, monkeypatch):
    overrides = [
        'judge.path="/models/judge"',
        "judge.replicas=2",
        'teacher.path="/models/teacher"',
        "trainer.distill.coef=1.0",
    ]
    overrides += ['teacher.engine="vllm"', "teacher.max_model_len=64"]
    launch = Launch(load_recipe(JUDGED, overrides), tmp_path, "model", gpus_available=0)
    try:
        launch.plan("redis://127.0.0.1:1")
        by_name = {s.name: s for s in launch.services}
    finally:
        launch.ports.close()
    judges = [by_name["judge-0"], by_name["judge-1"]]
    assert [j.env["STEADYRL_INFERENCE_POOL"] for j in judges] == ["judge", "judge"]
    assert {j.env["STEADYRL_INFERENCE_MODEL_PATH"] for j in judges} == {"/models/judge"}
    assert (
        judges[0].env["STEADYRL_INFERENCE_ENGINE"] == "torch"
        and "STEADYRL_INFERENCE_VLLM__MAX_MODEL_LEN" not in judges[0].env
    )
    teacher = by_name["teacher-0"].env  # a teacher on vLLM: its prompt logprobs, in the pool's context length
    assert (teacher["STEADYRL_INFERENCE_ENGINE"], teacher["STEADYRL_INFERENCE_VLLM__MAX_MODEL_LEN"]) == ("vllm", "64")
    replica = by_name["inference-0"].env
    assert json.loads(replica["STEADYRL_INFERENCE_JUDGE__ADDRESSES"]) == [f"127.0.0.1:{j.grpc_port}" for j in judges]
    assert json.loads(replica["STEADYRL_INFERENCE_TEACHER__ADDRESSES"]) == [
        f"127.0.0.1:{by_name['teacher-0'].grpc_port}"
    ]
    assert replica["STEADYRL_INFERENCE_JUDGE__TEMPLATES__ARITH__PROMPT"] == "{prompt}{response}?"
    for name, value in replica.items():  # the replica reads its templates back from its environment
        monkeypatch.setenv(name, value)
    template = InferenceSettings().judge.templates["arith"]
    assert (template.rule, template.max_new_tokens, template.compare_with) == ("yes_no", 6, "exact_match")
    assert (template.markers, template.verdict_pattern) == (("", ""), r"\d{1,4} (?P<verdict>[yn])")  # the kit's
