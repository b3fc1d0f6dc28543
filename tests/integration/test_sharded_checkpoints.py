"""Sharded checkpoints (torch.distributed.checkpoint) on gloo ranks, through the trainer's own
StepRunner: saved asynchronously while the next step trains, resumed on another world size and
layout (2 FSDP ranks → 4 ranks as HSDP 2 × 2 → 2 FSDP ranks) equal to what was saved — model,
AdamW moments and step counts — and exported into a Hugging Face directory that transformers
loads and whose greedy outputs equal the trainer's model."""

import json
import os

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from services.trainer.checkpoint import TrainerState, latest_checkpoint
from services.trainer.config import TrainerSettings
from services.trainer.parallel import full_state
from shared.rollouts.record import decode_rollout, encode_rollout
from shared.runstore.redis_server import free_port
from shared.runtime.distributed import exit_rank
from steadyrl.report import export_checkpoint
from tests.integration.test_trainer import recorded_rollouts


def flat_full(model, optimizer) -> dict[str, torch.Tensor]:
    """The full model and optimizer state on rank 0 (a collective), flat."""
    model_state, optimizer_state = full_state(model, optimizer)
    flat = {f"model.{k}": v.contiguous() for k, v in model_state.items()}
    for name, entry in optimizer_state.get("state", {}).items():
        flat.update({f"optim.{name}::{key}": torch.as_tensor(v).contiguous() for key, v in entry.items()})
    return flat


def worker(
    rank: int, world: int, port: int, model_dir: str, root: str, data: list[bytes], phase: str, parallel: str
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from services.trainer.model_runner import StepRunner

    settings = TrainerSettings(
        model_path=model_dir,
        out_dir=root,
        tensorboard=False,
        parallel={"mode": parallel, "shard_ranks": 2},
        compute={"precision": "fp32", "device": "cpu", "torch_threads": 1},
        optim={"lr": 1e-2},
    )
    runner = StepRunner(settings)
    rollouts = [decode_rollout(d) for d in data]
    state = runner.restore()
    if phase != "save":  # what was restored, as rank 0 sees it whole
        restored = flat_full(runner.model, runner.optimizer)
        if rank == 0:
            save_file(restored, f"{root}/restored-{phase}.safetensors")
            (runner.checkpoints.parent / f"restored-{phase}.json").write_text(
                json.dumps({"step": state.step, "version": state.version, "consumed": len(state.consumed)})
            )
    runner._step(rollouts, state.version)  # every rank trains the same global batch (as `follow` does)
    state = TrainerState(state.step + 1, state.version + 1, state.consumed | {r.rollout_id for r in rollouts})
    expected = flat_full(runner.model, runner.optimizer)
    if rank == 0:
        save_file(expected, f"{root}/saved-step-{state.step}.safetensors")
    (runner.checkpoints / f".tmp-step-{state.step:08d}-cut").mkdir(parents=True, exist_ok=True)  # a crashed attempt
    pending = runner._save(state.step, f"{phase}-attempt", state if rank == 0 else None)
    runner._step(rollouts, state.version)  # the next step trains while the shards are written
    pending.finish()
    exit_rank()


def run(world: int, model_dir, root, rollouts, phase: str, parallel: str) -> None:
    mp.start_processes(
        worker,
        args=(world, free_port(), str(model_dir), str(root), [encode_rollout(r) for r in rollouts], phase, parallel),
        nprocs=world,
        join=True,
        start_method="spawn",
    )


def test_a_sharded_async_checkpoint_resumes_on_another_world_size_and_exports(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts

    rollouts = recorded_rollouts(tiny_model_dir, 4, seed=93)  # 4 groups: whole groups on 2 or 4 ranks
    run(2, tiny_model_dir, tmp_path, rollouts, "save", "fsdp")  # step 1 saved async by 2 FSDP ranks
    checkpoints = tmp_path / "checkpoints"
    first = latest_checkpoint(checkpoints)
    assert first.name == "step-00000001" and sorted(p.name for p in (first / "shards").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    assert json.loads((first / "state.json").read_text())["format"] == "dcp"
    assert not list(checkpoints.glob(".tmp-step-*"))  # the attempt cut short was cleared
    run(4, tiny_model_dir, tmp_path, rollouts, "2to4", "hsdp")  # resumed by 4 ranks (2 × 2), step 2 saved
    run(2, tiny_model_dir, tmp_path, rollouts, "4to2", "fsdp")  # resumed by 2 ranks

    for phase, step in (("2to4", 1), ("4to2", 2)):
        saved, restored = (
            load_file(tmp_path / f"saved-step-{step}.safetensors"),
            load_file(tmp_path / f"restored-{phase}.safetensors"),
        )
        assert set(saved) == set(restored) and any(k.endswith("::exp_avg_sq") for k in saved), phase
        worst = max(float((saved[k].float() - restored[k].float()).abs().max()) for k in saved)
        assert worst == 0.0, (phase, worst)  # model, moments and AdamW step counts, bit for bit
        meta = json.loads((tmp_path / f"restored-{phase}.json").read_text())
        assert meta == {"step": step, "version": step, "consumed": len(rollouts)}, meta
    second = json.loads((checkpoints / "step-00000002" / "state.json").read_text())
    assert second["step"] == 2 and len(second["consumed"]) == len(rollouts)
    # the step that trained while step 1 was written did not leak into it
    start = load_file(tmp_path / "saved-step-1.safetensors")
    assert (
        max(
            float((start[k] - load_file(tmp_path / "saved-step-2.safetensors")[k]).abs().max())
            for k in start
            if k.startswith("model.")
        )
        > 1e-4
    )

    exported = export_checkpoint(str(tiny_model_dir), checkpoints / "step-00000002", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    weights = load_file(tmp_path / "saved-step-2.safetensors")
    trainer.load_state_dict({k[len("model.") :]: v for k, v in weights.items() if k.startswith("model.")})
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in trainer.state_dict().items())
    for prompt in encode_prompts(char_tokenizer(), [e.prompt for e in TinySpec().task(9).split("eval", 8)]):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            assert torch.equal(
                hf.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0),
                trainer.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0),
            )
