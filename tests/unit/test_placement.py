"""GPU placement of a run's processes (a simulated inventory: this machine has no GPU)."""

from pathlib import Path

import pytest

from services.inference.config import InferenceSettings
from services.inference.server import engine_options
from steadyrl.placement import plan_placement
from steadyrl.processes import Launch, start_after
from steadyrl.progress import caught_up
from steadyrl.recipe import load_recipe
from steadyrl.service_settings import build_settings

ROOT = Path(__file__).resolve().parents[2]
GPU_RUN = ["run.replicas=2", "inference.gpus_per_replica=2", "trainer.parallel.gpus=4", "inference.engine=vllm"]


def planned(tmp_path, overrides, gpus: int) -> Launch:
    tmp_path.mkdir(parents=True, exist_ok=True)
    launch = Launch(
        load_recipe(ROOT / "configs" / "tiny-arith.toml", overrides), tmp_path, "model", gpus_available=gpus
    )
    launch.plan("redis://127.0.0.1:1/0")
    return launch


def test_each_process_gets_its_own_gpus_and_the_trainer_runs_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setattr("shared.engines.vllm_unavailable", lambda: None)  # a GPU box has vLLM
    launch = planned(tmp_path, GPU_RUN, gpus=8)
    devices = {s.name: s.devices["CUDA_VISIBLE_DEVICES"] for s in launch.services}
    assert devices == {
        "weightsync": "",
        "trainer": "0,1,2,3",
        "inference-0": "4,5",
        "inference-1": "6,7",
        "orchestrator": "",
    }
    trainer = next(s for s in launch.services if s.name == "trainer")
    assert trainer.argv[:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port"]
    assert trainer.argv[-2:] == ["-m", "services.trainer"]
    replica = next(s for s in launch.services if s.name == "inference-0")
    settings = build_settings("inference", replica.env)
    assert settings.gpus_per_replica == 2 and engine_options(settings)["tensor_parallel_size"] == 2
    # the trainer publishes in the replicas' dtype unless told otherwise
    assert trainer.env["STEADYRL_TRAINER_PUBLISH__DTYPE"] == "bfloat16"


def test_pool_replicas_get_their_own_gpus_after_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr("shared.engines.vllm_unavailable", lambda: None)
    pools = ['teacher.path="/models/teacher"', "teacher.replicas=2", "teacher.gpus_per_replica=1"]
    pools.append("trainer.distill.coef=1.0")
    launch = planned(tmp_path, [*GPU_RUN, *pools], gpus=10)
    devices = {s.name: s.devices["CUDA_VISIBLE_DEVICES"] for s in launch.services}
    assert (devices["inference-1"], devices["teacher-0"], devices["teacher-1"]) == ("6,7", "8", "9")
    teacher = build_settings("inference", next(s for s in launch.services if s.name == "teacher-0").env)
    assert teacher.gpus_per_replica == 1 and engine_options(teacher)["device"] == "cuda"
    with pytest.raises(ValueError, match=r"needs 10 GPUs \(.* \+ 2 teacher replicas × 1\) and this machine has 9"):
        planned(tmp_path / "fewer", [*GPU_RUN, *pools], gpus=9)
    cpu = plan_placement(0, 1, 1, 0, 0, pools={"judge": (2, 0)})
    assert cpu.pools == {"judge": ((), ())}  # on the CPU nothing changes


def test_a_recipe_needing_more_gpus_than_exist_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("shared.engines.vllm_unavailable", lambda: None)
    with pytest.raises(
        ValueError,
        match=r"needs 8 GPUs \(trainer.parallel.gpus 4 \+ 2 replicas × inference.gpus_per_replica "
        r"2\) and this machine has 4",
    ):
        planned(tmp_path, GPU_RUN, gpus=4)
    assert not (tmp_path / "logs").exists()


def test_on_the_cpu_nothing_changes(tmp_path):
    launch = planned(tmp_path, [], gpus=0)
    assert {s.devices["CUDA_VISIBLE_DEVICES"] for s in launch.services} == {""}
    assert [s.argv for s in launch.services if s.name == "trainer"] == [["-m", "services.trainer"]]
    cpu_ranks = planned(tmp_path / "ranks", ["trainer.parallel.ranks=2"], gpus=0)
    trainer = next(s for s in cpu_ranks.services if s.name == "trainer")
    assert trainer.argv[3] == "2" and trainer.devices["CUDA_VISIBLE_DEVICES"] == ""
    assert plan_placement(0, 0, 3, 0, 0).replicas == ((), (), ())
    assert engine_options(InferenceSettings(model_path="m", engine="torch")) == {
        "max_num_seqs": 256,
        "update_mode": "in_flight",
    }


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_quantization_options_reach_each_engine_as_it_takes_them(fmt):
    torch_options = engine_options(
        InferenceSettings(
            model_path="m", engine="torch", quantization=fmt, quantize_router=True, quantize_activations=True
        )
    )
    assert torch_options["quantization"] == fmt and torch_options["quantize_router"] is True
    assert torch_options["quantize_activations"] is True
    vllm_options = engine_options(
        InferenceSettings(
            model_path="m", engine="vllm", quantization=fmt, quantize_router=True, quantize_activations=True
        )
    )
    assert vllm_options["quantization"] == fmt  # vLLM's own schemes have no such switches
    assert "quantize_router" not in vllm_options and "quantize_activations" not in vllm_options


def test_a_torch_replica_with_a_gpu_runs_its_engine_there(tmp_path):
    launch = planned(tmp_path, ["inference.gpus_per_replica=1", "trainer.parallel.gpus=1"], gpus=2)
    devices = {s.name: s.devices["CUDA_VISIBLE_DEVICES"] for s in launch.services}
    assert devices["trainer"] == "0" and devices["inference-0"] == "1"
    replica = next(s for s in launch.services if s.name == "inference-0")
    assert engine_options(build_settings("inference", replica.env))["device"] == "cuda"
    with pytest.raises(ValueError, match="the torch engine runs on one GPU, gpus_per_replica = 2"):
        InferenceSettings(model_path="m", engine="torch", gpus_per_replica=2)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_a_torch_engine_asked_for_a_gpu_without_one_says_so(tiny_model_dir):
    from shared.engines import make_engine

    with pytest.raises(ValueError, match="asked for cuda and no CUDA device is visible"):
        make_engine("torch", str(tiny_model_dir), "float32", device="cuda")


def test_colocated_replicas_share_the_trainers_gpus(tmp_path, monkeypatch):
    one = planned(
        tmp_path / "one", ["run.colocate=true", "trainer.parallel.gpus=1", "inference.gpus_per_replica=1"], gpus=1
    )
    assert {s.name: s.devices["CUDA_VISIBLE_DEVICES"] for s in one.services} == {
        "weightsync": "",
        "trainer": "0",
        "inference-0": "0",
        "orchestrator": "",
    }
    assert plan_placement(4, 0, 3, 2, 4, colocate=True).replicas == ((0, 1), (2, 3), (0, 1))  # wraps around
    assert plan_placement(2, 0, 2, 1, 2, colocate=True).trainer == (0, 1)
    with pytest.raises(
        ValueError, match=r"it needs trainer.parallel.gpus >= inference.gpus_per_replica >= 1 \(they are 0 and 1\)"
    ):
        planned(tmp_path / "cpu", ["run.colocate=true", "inference.gpus_per_replica=1"], gpus=1)
    with pytest.raises(
        ValueError,
        match=r"needs 2 GPUs \(trainer.parallel.gpus, the replicas colocated on them\) and this "
        r"machine has 1",
    ):
        planned(
            tmp_path / "few", ["run.colocate=true", "trainer.parallel.gpus=2", "inference.gpus_per_replica=1"], gpus=1
        )
    monkeypatch.setattr("shared.engines.vllm_unavailable", lambda: None)
    vllm = ["run.colocate=true", "trainer.parallel.gpus=1", "inference.gpus_per_replica=1", "inference.engine=vllm"]
    with pytest.raises(ValueError, match=r"set inference.vllm.gpu_memory_utilization <= 0.5 \(it is 0.85\)"):
        planned(tmp_path / "vllm", vllm, gpus=1)
    shared = planned(tmp_path / "ok", [*vllm, "inference.vllm.gpu_memory_utilization=0.4"], gpus=1)
    assert next(s for s in shared.services if s.name == "inference-0").devices["CUDA_VISIBLE_DEVICES"] == "0"
    # the services start at once, but one on a GPU already in use waits for the earlier ones there
    assert start_after(shared.services) == [set(), set(), {"trainer"}, set()]
    two = planned(
        tmp_path / "two",
        ["run.colocate=true", "trainer.parallel.gpus=2", "inference.gpus_per_replica=1", "run.replicas=3"],
        gpus=2,
    )
    assert dict(zip([s.name for s in two.services], start_after(two.services), strict=True)) == {
        "weightsync": set(),
        "trainer": set(),
        "inference-0": {"trainer"},
        "inference-1": {"trainer"},
        "inference-2": {"trainer", "inference-0"},
        "orchestrator": set(),
    }
    apart = planned(
        tmp_path / "apart", ["trainer.parallel.gpus=1", "inference.gpus_per_replica=1", "run.replicas=2"], gpus=3
    )
    assert start_after(apart.services) == [set()] * 5


def test_the_policy_eval_replica_is_one_more_replica_serving_unquantised(tmp_path, monkeypatch):
    """orchestrator.evals.policy: `steadyrl run` plans one replica of the policy_eval pool after the
    rollout replicas, on GPUs of its own, with the recipe's engine and dtype but no quantization."""
    monkeypatch.setattr("shared.engines.vllm_unavailable", lambda: None)
    recipe = [*GPU_RUN, 'inference.quantization="fp8"', "orchestrator.evals.policy=true"]
    with pytest.raises(ValueError, match=r"needs 10 GPUs \(trainer.parallel.gpus 4 \+ 3 replicas"):
        planned(tmp_path / "small", recipe, gpus=8)
    launch = planned(tmp_path / "big", recipe, gpus=10)
    devices = {s.name: s.devices["CUDA_VISIBLE_DEVICES"] for s in launch.services if s.name.startswith("inference")}
    assert devices == {"inference-0": "4,5", "inference-1": "6,7", "inference-policy": "8,9"}
    settings = {s.name: build_settings("inference", s.env) for s in launch.services if s.name.startswith("inference")}
    assert [(s.pool, s.quantization, s.replica_id, s.engine, s.dtype) for s in settings.values()] == [
        ("rollouts", "fp8", "replica-0", "vllm", "bfloat16"),
        ("rollouts", "fp8", "replica-1", "vllm", "bfloat16"),
        ("policy_eval", "none", "replica-policy", "vllm", "bfloat16"),
    ]
    cpu = planned(
        tmp_path / "cpu",
        ['inference.quantization="fp4"', "inference.quantize_activations=true", "orchestrator.evals.policy=true"],
        gpus=0,
    )
    policy = build_settings("inference", next(s for s in cpu.services if s.name == "inference-policy").env)
    assert (policy.quantization, policy.quantize_activations, policy.engine) == ("none", False, "torch")
    assert [s.name for s in cpu.services] == [
        "weightsync",
        "trainer",
        "inference-0",
        "inference-policy",
        "orchestrator",
    ]
    # the run's end waits for π's replica to report the last version too, not only the rollout replicas
    assert cpu.inference_replicas() == 2
    rollouts_only = {"trainer_version": 4, "replica_versions": {"replica-0": 4}}
    assert caught_up(rollouts_only, 1) and not caught_up(rollouts_only, cpu.inference_replicas())
    assert caught_up({"trainer_version": 4, "replica_versions": {"replica-0": 4, "replica-policy": 4}}, 2)


def test_a_policy_eval_replica_refuses_a_quantization(tiny_model_dir):
    with pytest.raises(ValueError, match='quantization must be "none", not "fp4"'):
        InferenceSettings(model_path=str(tiny_model_dir), pool="policy_eval", quantization="fp4")
