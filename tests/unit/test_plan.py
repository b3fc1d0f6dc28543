"""`steadyrl plan`: parameters counted exactly from the models' configs, the sizes derived from
them and the recipe, the GPU guide's tables (docs/guides/gpus.md) equal to the command's output,
the deploy files sized to hold what the plan says."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from steadyrl.plan import model_config, model_size, plan, render
from steadyrl.recipe import load_recipe
from steadyrl.service_settings import settings_of

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"gpu-qwen3-moe-math": "Qwen3-30B-A3B", "gpu-qwen3-math": "Qwen3-8B"}


def sized(recipe: str, *overrides: str) -> dict:
    config = load_recipe(ROOT / "configs" / f"{recipe}.toml", list(overrides))
    size = model_size(model_config(ROOT / "configs" / "models" / f"{RECIPES[recipe]}.json"))
    return plan(size, settings_of(config), config.replicas, 2e9)


def test_the_moe_recipe_is_sized_from_the_model_s_parameters():
    p = sized("gpu-qwen3-moe-math")
    n = p["model"]["parameters"]
    assert n == 30_532_122_624  # Qwen3-30B-A3B: "30.5B in total"
    assert 3.3e9 < p["model"]["active_parameters_per_token"] < 3.4e9  # "3.3B activated"
    assert p["trainer"]["params_grads_adamw_bytes_per_rank"] == 16 * n / 8  # FSDP over 8 GPUs
    assert p["trainer"]["reference_bytes_per_rank"] == 0  # no KL term: no reference
    kl = sized("gpu-qwen3-moe-math", "trainer.loss.kl_coef=0.001")
    assert kl["trainer"]["reference_bytes_per_rank"] == 4 * n / 8  # the fp32 reference, sharded alike
    assert p["checkpoint"]["bytes"] == 12 * n and p["checkpoint"]["write_seconds"] == pytest.approx(12 * n / 2e9)
    assert p["weights"]["version_bytes"] == 2 * n and p["weights"]["weightsync_memory_bytes"] == 4 * n
    assert p["redis"]["trace_bytes_per_token"] == 48 * 8  # 384 B per token
    assert p["redis"]["rollouts_outstanding"] == 3 * 64 * 16  # (max_staleness + 1 + lookahead_batches) × B × G
    assert p["gpus"] == {"trainer": 8, "inference": 4, "total": 12}
    assert p["model"]["disk_bytes"] == 2 * n  # bf16 safetensors
    assert p["checkpoint"]["volume_bytes"] == 3 * 12 * n  # checkpoint.keep 2 + the one being written
    rollout = p["redis"]["rollout_bytes"]
    assert rollout > 2**20 and p["redis"]["dead_letter_bytes"] == 10_000 * 2**20  # 1 MiB of each dead letter
    assert p["redis"]["bytes"] == 3 * 1024 * rollout + 10_000 * 2**20


def test_nodes_and_hsdp_change_what_each_rank_and_node_holds():
    fsdp = sized("gpu-qwen3-moe-math", "trainer.parallel.nodes=2", "trainer.parallel.rdzv_endpoint=node-0:29400")
    hsdp = sized(
        "gpu-qwen3-moe-math",
        "trainer.parallel.nodes=2",
        "trainer.parallel.rdzv_endpoint=node-0:29400",
        "trainer.parallel.mode=hsdp",
    )
    one = sized("gpu-qwen3-moe-math")
    n = one["model"]["parameters"]
    assert fsdp["trainer"]["params_grads_adamw_bytes_per_rank"] == 16 * n / 16
    assert hsdp["trainer"]["params_grads_adamw_bytes_per_rank"] == one["trainer"]["params_grads_adamw_bytes_per_rank"]
    assert hsdp["trainer"]["shard_group"] == 8 and hsdp["trainer"]["ranks"] == 16
    assert fsdp["checkpoint"]["async_host_bytes_per_node"] == one["checkpoint"]["async_host_bytes_per_node"] / 2
    assert hsdp["checkpoint"]["bytes_written_per_rank"] == one["checkpoint"]["bytes_written_per_rank"] / 2


def test_a_dense_model_has_no_trace():
    p = sized("gpu-qwen3-math")
    assert p["model"]["parameters"] == 8_190_735_360 and p["redis"]["trace_bytes_per_token"] == 0


@pytest.mark.process  # starts a steadyrl process: not in the fast tier
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_gpu_guide_shows_the_command_s_own_tables(recipe):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "plan",
            f"configs/{recipe}.toml",
            "--model-config",
            f"configs/models/{RECIPES[recipe]}.json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == render(sized(recipe), load_recipe(ROOT / "configs" / f"{recipe}.toml").run_id)
    assert done.stdout.strip() in (ROOT / "docs" / "guides" / "gpus.md").read_text()


@pytest.mark.process  # starts a steadyrl process: not in the fast tier
def test_a_missing_model_config_is_refused_with_a_pointer():
    done = subprocess.run(
        [sys.executable, "-m", "steadyrl.cli", "plan", "configs/gpu-qwen3-math.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--model-config" in done.stderr


def quantity(text: str) -> float:
    """A Kubernetes quantity (Gi, Ti) or a Redis memory size (gb, mb) in bytes."""
    number, unit = re.fullmatch(r"(\d+)(Gi|Ti|gb|mb)", str(text)).groups()
    return int(number) * {"Gi": 1024**3, "Ti": 1024**4, "gb": 1024**3, "mb": 1024**2}[unit]


def undersized(docs: list[dict], p: dict, recipe) -> list[str]:
    """Every rendered resource of the gpu overlay that is below what the plan says it must hold."""
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pods = {
        name: d["spec"]["template"]["spec"]
        for (kind, name), d in named.items()
        if kind in ("Deployment", "StatefulSet")
    }
    first = {name: pod["containers"][0] for name, pod in pods.items()}
    claims = {
        name: quantity(d["spec"]["resources"]["requests"]["storage"])
        for (kind, name), d in named.items()
        if kind == "PersistentVolumeClaim"
    }
    template = {
        name: quantity(
            named["StatefulSet", name]["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
        )
        for name in ("trainer", "redis")
    }
    spill = next(v for v in pods["weightsync"]["volumes"] if v["name"] == "spill")["emptyDir"]["sizeLimit"]
    redis = first["redis"]
    maxmemory = quantity(next(e["value"] for e in redis["env"] if e["name"] == "REDIS_MAXMEMORY"))
    trainer_gpus = recipe["trainer"].parallel.gpus
    replica_gpus = recipe["inference"].gpus_per_replica
    scaler = named["ScaledObject", "inference"]["spec"]
    startup = first["inference"]["startupProbe"]
    checks = {
        "model volume < the model on disk": claims["steadyrl-models"] >= p["model"]["disk_bytes"],
        "checkpoint volume < checkpoint.keep + 1 checkpoints": template["trainer"] >= p["checkpoint"]["volume_bytes"],
        "trainer memory < its async checkpoint staging": quantity(first["trainer"]["resources"]["limits"]["memory"])
        >= p["checkpoint"]["async_host_bytes_per_node"],
        "trainer grace period < its final save": pods["trainer"]["terminationGracePeriodSeconds"]
        >= p["checkpoint"]["write_seconds"],
        "weight-sync memory < memory_versions versions": quantity(first["weightsync"]["resources"]["limits"]["memory"])
        >= p["weights"]["weightsync_memory_bytes"],
        "weight-sync spill < the versions spilled": quantity(spill) >= p["weights"]["weightsync_disk_bytes"],
        "Redis maxmemory < queue + dead letters": maxmemory >= p["redis"]["bytes"],
        "Redis limit < maxmemory + the AOF rewrite's fork": quantity(redis["resources"]["limits"]["memory"])
        >= 1.5 * maxmemory,
        "Redis volume < an AOF twice maxmemory": template["redis"] >= 2 * maxmemory,
        "trainer GPUs != trainer.parallel.gpus": first["trainer"]["resources"]["limits"]["nvidia.com/gpu"]
        == trainer_gpus,
        "replica GPUs != gpus_per_replica": first["inference"]["resources"]["limits"]["nvidia.com/gpu"] == replica_gpus,
        "KEDA maxReplicaCount != the inference GPU budget / a replica's": scaler["maxReplicaCount"]
        == p["gpus"]["inference"] // replica_gpus,
        "KEDA scale-down stabilization <= a replica's load time": scaler["advanced"]["horizontalPodAutoscalerConfig"][
            "behavior"
        ]["scaleDown"]["stabilizationWindowSeconds"]
        > startup["failureThreshold"] * startup["periodSeconds"],
    }
    return [name for name, ok in checks.items() if not ok]


def test_the_gpu_overlay_holds_what_the_plan_says(tmp_path):
    """Every size the gpu overlay renders is at least what `steadyrl plan` says of its recipe (model
    and checkpoint volumes, memory, Redis maxmemory, the trainer's grace period, GPUs, the scaler);
    a copy with the model volume cut to 10Gi and Redis's maxmemory to 4gb is caught."""
    import shutil

    from tests.deploy.test_deploy import DEPLOY
    from tests.deploy.test_deploy import render as render_overlay

    p = sized("gpu-qwen3-moe-math")
    recipe = settings_of(load_recipe(ROOT / "configs" / "gpu-qwen3-moe-math.toml"))
    assert undersized(render_overlay("gpu"), p, recipe) == []
    shutil.copytree(DEPLOY, tmp_path / "deploy", ignore=shutil.ignore_patterns("node_modules"))
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    claims = tmp_path / "deploy" / "k8s" / "overlays" / "gpu" / "models-pvc.yaml"
    claims.write_text(claims.read_text().replace("storage: 100Gi", "storage: 10Gi"))
    overlay = tmp_path / "deploy" / "k8s" / "overlays" / "gpu" / "kustomization.yaml"
    overlay.write_text(overlay.read_text().replace("value: 24gb", "value: 4gb"))
    assert undersized(render_overlay("gpu", tmp_path / "deploy"), p, recipe) == [
        "model volume < the model on disk",
        "Redis maxmemory < queue + dead letters",
    ]


@pytest.mark.process  # starts a steadyrl process: not in the fast tier
def test_dry_run_includes_the_plan_when_the_model_is_on_the_machine(tiny_model_dir):
    import json

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            "configs/tiny-arith.toml",
            "--set",
            f"model.path={tiny_model_dir}",
            "--dry-run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout)["plan"]
    assert shown["model"]["parameters"] == model_size(model_config(tiny_model_dir)).parameters > 100_000
    assert shown["redis"]["trace_bytes_per_token"] == shown["model"]["num_layers"] * shown["model"]["top_k"]
