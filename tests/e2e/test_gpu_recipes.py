"""The GPU recipes' whole path on this CPU: each `configs/gpu-*.toml` run by `steadyrl run` with
the tiny MoE, the torch engine and the arith task substituted, and GPUs turned into 2 gloo ranks
— FSDP2, bf16-mixed, micro-batches, activation checkpointing, bf16 publishing and the placement
logic are the recipe's own."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
TINY_FP32_BYTES = 230_848 * 4


# slow: the dense recipe's path (FSDP2, bf16-mixed, micro-batches, checkpointing, bf16 publishing) is the
# MoE recipe's run below, which adds the MoE's; tests/unit/test_configs.py validates both recipes
@pytest.mark.parametrize(
    "recipe", [pytest.param("gpu-qwen3-math.toml", marks=pytest.mark.slow), "gpu-qwen3-moe-math.toml"]
)
def test_a_gpu_recipe_runs_its_path_on_the_cpu(tmp_path, tiny_model_dir, recipe):
    out = tmp_path / "run"
    substitutes = [
        "model.path=tiny",
        "trainer.parallel.gpus=0",
        "trainer.parallel.ranks=2",
        "trainer.compute.micro_batch_tokens=40",
        "inference.gpus_per_replica=0",
        "inference.engine=torch",
        "inference.tasks.per_batch=2",
        "orchestrator.data.task=arith",
        "orchestrator.sampling.max_new_tokens=6",
        "orchestrator.evals.every=0",
        "run.steps=3",
        "run.batch_prompts=4",
        "run.group_size=4",
        "run.replicas=1",
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / recipe),
            "--out",
            str(out),
            *[a for s in substitutes for a in ("--set", s)],
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == 3
    trainer_log = (out / "logs" / "trainer.log").read_text()
    for rank in (0, 1):
        assert (
            f"event=trainer_layout rank={rank} world=2 device=cpu precision=bf16-mixed parallel=fsdp "
            "micro_batch_tokens=40 activation_checkpointing=True"
        ) in trainer_log
    published = [
        int(b)
        for b in re.findall(
            r"event=version_published version=\d+ kind=full (?:transport=\w+ )?bytes=(\d+)",
            (out / "logs" / "weightsync.log").read_text(),
        )
    ]
    assert published and set(published) == {TINY_FP32_BYTES // 2}  # bf16, as the replicas run
    assert set(summary["final_status"]["replica_versions"].values()) == {3}
    assert summary.get("final_model")  # the gathered checkpoint exports as a whole model
