"""A recipe's [teacher] pool: validated before anything starts, and `steadyrl run`'s plan starts its
replicas (pool `teacher`, the teacher's model) and gives their addresses to the rollout replicas
alone (π's eval replica and the trainer never call it)."""

import json
from pathlib import Path

import pytest

from steadyrl.processes import Launch
from steadyrl.run_config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "tiny-arith.toml"


def test_the_teacher_section_is_validated_with_its_name():
    config = load_run_config(RECIPE, ['teacher.path="/models/teacher"', "teacher.replicas=2"])
    assert config.teacher.path == "/models/teacher" and config.teacher.replicas == 2
    assert '[teacher]\npath = "/models/teacher"' in config.as_toml()
    assert load_run_config(RECIPE).teacher is None
    with pytest.raises(ValueError, match=r"(?s)\[teacher\].*pth"):
        load_run_config(RECIPE, ['teacher.path="/m"', 'teacher.pth="/m"'])
    with pytest.raises(ValueError, match=r"(?s)\[teacher\].*replicas"):
        load_run_config(RECIPE, ['teacher.path="/m"', "teacher.replicas=0"])


def test_the_plan_starts_the_pool_and_points_the_rollout_replicas_at_it(tmp_path):
    overrides = ['teacher.path="/models/teacher"', "teacher.replicas=2", "run.replicas=2"]
    overrides.append("orchestrator.evals.policy=true")
    launch = Launch(load_run_config(RECIPE, overrides), tmp_path, "model", gpus_available=0)
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
    assert "STEADYRL_INFERENCE_TEACHER__ADDRESSES" not in by_name["inference-policy"].env
    assert launch.inference_replicas() == 3  # the pool is not a rollout replica
