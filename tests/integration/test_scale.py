"""The trainer's scale path on CPU: micro-batches, bf16-mixed precision, FSDP2 over gloo ranks —
the same code that runs on CUDA with nccl."""

import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from services.trainer.batch import collate, token_budget_chunks
from services.trainer.checkpoint import load_model_weights
from services.trainer.config import TrainerSettings
from services.trainer.forward import Compute, sequence_logprobs
from services.trainer.global_step import StepConfig, train_step
from services.trainer.parallel import full_state, prepare, prepare_reference
from shared.core.loss import LossConfig
from shared.models import load_causal_lm
from shared.models.routing import RoutingController
from shared.rollouts.record import decode_rollout, encode_rollout
from shared.runstore.redis_server import free_port
from shared.runtime.distributed import exit_rank
from shared.weightsync.manifest import CastView
from tests.integration.test_trainer import GROUP, recorded_rollouts


def lora_model(model_dir, lora: int):
    """The tiny MoE, with a rank-`lora` adapter on attention and experts when `lora` (seeded by the caller)."""
    model = load_causal_lm(model_dir, "float32")
    if lora:
        from shared.models.lora import apply_lora

        model = apply_lora(model, lora, 2.0 * lora, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"], True)
    return model.train()


def step(
    model_dir,
    rollouts,
    config: StepConfig,
    compute: Compute = Compute(),  # noqa: B008
    lr: float = 1e-3,
    lora: int = 0,
    reference_dir: str = "",
    sgd: bool = False,
):
    torch.manual_seed(0)
    model = lora_model(model_dir, lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    # SGD at lr 1: the weights move by the gradient itself. AdamW's first step moves each weight by
    # lr·g/(|g|+eps), which turns a gradient near eps summed in another order into up to lr/2.
    optimizer = torch.optim.SGD(trained, lr=1.0) if sgd else torch.optim.AdamW(trained, lr=lr)
    reference = load_causal_lm(reference_dir, "float32").eval().requires_grad_(False) if reference_dir else None
    metrics = train_step(
        model,
        optimizer,
        RoutingController(model),
        collate(rollouts),
        GROUP,
        config,
        0,
        compute=compute,
        reference=reference,
    )
    return model, metrics


def perturbed_model(model_dir, out) -> str:
    """The tiny model with every weight moved by seeded noise: a reference that differs from the policy."""
    torch.manual_seed(7)
    model = load_causal_lm(model_dir, "float32")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(out)
    return str(out)


def worst_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_micro_batches_make_the_unsplit_update(tiny_model_dir):
    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=81)  # 8 rows, one mini-batch
    lengths = collate(rollouts).lengths().tolist()
    budget = next(b for b in range(max(lengths), sum(lengths)) if len(token_budget_chunks(lengths, b)) == 3)
    for config in (StepConfig(replay="r2"), StepConfig(replay="r3"), StepConfig(loss=StepConfig().loss.grpo())):
        whole, whole_metrics = step(tiny_model_dir, rollouts, config, sgd=True)
        split, split_metrics = step(tiny_model_dir, rollouts, config, Compute(micro_batch_tokens=budget), sgd=True)
        worst = worst_difference(whole.state_dict(), split.state_dict())  # the gradients' difference
        print(f"{config.replay} {config.loss.normalization}: 3 micro-batches vs 1, max |Δgrad| {worst:.2e}")
        assert worst <= 1e-6
        for key in ("loss", "mismatch_kl_k3", "is_weight_max", "entropy", "grad_norm"):
            assert abs(whole_metrics[key] - split_metrics[key]) <= 1e-5 * max(1, abs(whole_metrics[key])), key


def test_bf16_mixed_is_close_to_fp32_and_the_loss_math_stays_fp32(tiny_model_dir):
    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=83)
    start = load_causal_lm(tiny_model_dir, "float32").state_dict()
    fp32, _ = step(tiny_model_dir, rollouts, StepConfig(), lr=1e-4)
    bf16, _ = step(tiny_model_dir, rollouts, StepConfig(), Compute(autocast=torch.bfloat16), lr=1e-4)
    fp32_update = torch.cat([(fp32.state_dict()[k] - v).flatten() for k, v in start.items()])
    bf16_update = torch.cat([(bf16.state_dict()[k] - v).flatten() for k, v in start.items()])
    cosine = float(torch.nn.functional.cosine_similarity(fp32_update, bf16_update, dim=0))
    relative = float((bf16_update - fp32_update).norm() / fp32_update.norm())
    print(
        f"bf16-mixed vs fp32, one step (lr 1e-4): cosine {cosine:.4f}, relative |Δ| {relative:.3f}, "
        f"max |Δparam| {float((bf16_update - fp32_update).abs().max()):.2e}"
    )
    assert all(p.dtype == torch.float32 for p in bf16.parameters())  # fp32 master weights
    assert cosine >= 0.9 and relative <= 0.45  # AdamW's first step is lr × sign(g): bf16 flips the smallest
    dtypes = []
    model = load_causal_lm(tiny_model_dir, "float32")
    model.lm_head.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    forward = sequence_logprobs(model, collate(rollouts), compute=Compute(autocast=torch.bfloat16))
    assert dtypes == [torch.bfloat16]  # the model computed in bf16...
    assert forward.logprobs.dtype == forward.entropy_per_token.dtype == torch.float32  # ...the loss math in fp32


def fsdp_worker(
    rank: int,
    world: int,
    port: int,
    model_dir: str,
    data: list[bytes],
    out: str,
    replay: str,
    parallel: str,
    device: str = "cpu",
    mini_batches: int = 2,
    lora: int = 0,
    kl_in: str = "",
    reference_dir: str = "",
) -> None:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = lora_model(model_dir, lora)
    routing = RoutingController(model)
    settings = TrainerSettings(
        model_path=model_dir, parallel={"mode": parallel, "shard_ranks": 2}, compute={"precision": "fp32"}
    )
    wrapped = prepare(model, settings, torch.device(device), world)
    if parallel == "hsdp":  # 2 replicas × 2 shards: each rank holds half of every parameter
        layout = {tuple(p.device_mesh.shape) for p in model.parameters()}
        assert layout == {(world // 2, 2)}, layout
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    reference = None
    if kl_in:  # the frozen reference, sharded like the policy under fsdp/hsdp
        reference = prepare_reference(load_causal_lm(reference_dir, "float32"), settings, torch.device(device), world)
        if parallel != "ddp":
            assert all(hasattr(p, "full_tensor") for p in reference.parameters())
    metrics = train_step(
        wrapped,
        optimizer,
        routing,
        collate([decode_rollout(d) for d in data]),
        GROUP,
        step_config(mini_batches, replay, kl_in),
        0,
        rank,
        world,
        Compute(torch.device(device)),
        reference,
    )
    model_state, optimizer_state = full_state(model, optimizer)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in model_state.items()}, out)
        with open(f"{out}.json", "w") as f:
            json.dump({"metrics": metrics, "moments": sorted(optimizer_state["state"])}, f)
    exit_rank()


def step_config(mini_batches: int, replay: str, kl_in: str = "") -> StepConfig:
    loss = LossConfig(kl_coef=0.05, kl_in=kl_in) if kl_in else LossConfig()
    return StepConfig(loss=loss, mini_batches=mini_batches, replay=replay)


@pytest.mark.parametrize(
    ("replay", "parallel", "world", "mini_batches", "lora", "kl_in"),
    [
        ("r2", "fsdp", 2, 2, 0, "reward"),  # KL to a sharded reference, in the reward (penalties summed over ranks)
        ("r3", "fsdp", 2, 2, 0, "loss"),  # ... and in the loss
        ("r2", "hsdp", 4, 1, 0, ""),  # N = 1: pi_old from the update's own forward, sharded
        ("r3", "ddp", 2, 2, 8, ""),
        ("r2", "hsdp", 4, 2, 8, ""),
    ],
)
def test_fsdp_on_gloo_ranks_updates_like_one_process(
    tmp_path, tiny_model_dir, replay, parallel, world, mini_batches, lora, kl_in
):
    """FSDP over 2 ranks, and HSDP over 4 as 2 replicas × 2 shards, equal to one process; with LoRA
    (rank 8 on attention and experts), by DDP and by HSDP, the adapter trains alike and the base
    stays as loaded; with a KL to a reference (a perturbed copy, sharded like the policy), alike too."""
    rollouts = recorded_rollouts(tiny_model_dir, 4, seed=85)  # 4 groups: mini-batches × ranks
    out = str(tmp_path / "fsdp.safetensors")
    reference_dir = perturbed_model(tiny_model_dir, tmp_path / "reference") if kl_in else ""
    mp.start_processes(
        fsdp_worker,
        args=(
            world,
            free_port(),
            str(tiny_model_dir),
            [encode_rollout(r) for r in rollouts],
            out,
            replay,
            parallel,
            "cpu",
            mini_batches,
            lora,
            kl_in,
            reference_dir,
        ),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    single, metrics = step(
        tiny_model_dir, rollouts, step_config(mini_batches, replay, kl_in), lora=lora, reference_dir=reference_dir
    )
    sharded = load_file(out)
    torch.manual_seed(0)
    start_model = lora_model(tiny_model_dir, lora)
    start = start_model.state_dict()
    trained = {n for n, p in start_model.named_parameters() if p.requires_grad}
    worst = worst_difference(single.state_dict(), sharded)
    moved = worst_difference({k: start[k] for k in trained}, sharded)
    print(
        f"{parallel}({world} gloo ranks, {replay}, lora {lora}) vs 1 process: max |Δparam| {worst:.2e}; "
        f"the step moved up to {moved:.2e}"
    )
    assert worst <= 1e-5 and moved > 1e-4
    if lora:  # the adapter alone trained; the frozen base (router included) as loaded
        assert trained == {k for k in start if ".lora_" in k}
        assert worst_difference({k: v for k, v in start.items() if k not in trained}, sharded) == 0
    saved = json.loads((tmp_path / "fsdp.safetensors.json").read_text())
    assert set(saved["moments"]) == trained  # AdamW state for every trained parameter, by name
    keys = ("mismatch_kl_k3", "is_weight_max", "entropy", "routing_agreement") + (("ref_kl",) if kl_in else ())
    if kl_in:
        assert metrics["ref_kl"] > 1e-3  # the reference differs: the term acts
    for key in keys:
        assert abs(saved["metrics"][key] - metrics[key]) <= 1e-5 * max(1, abs(metrics[key])), key


def test_published_weights_are_cast_one_tensor_at_a_time(tiny_model_dir):
    from shared.weightsync.manifest import describe

    model = load_causal_lm(tiny_model_dir, "float32")
    view = CastView(model.state_dict(), torch.bfloat16)
    bf16 = describe(view, 1, 0)
    fp32 = describe(model.state_dict(), 1, 0)
    assert {t.dtype for t in bf16.tensors} == {"bfloat16"} and [t.name for t in bf16.tensors] == list(view)
    assert sum(t.nbytes for t in bf16.tensors) * 2 == sum(t.nbytes for t in fp32.tensors)  # 0.5 of fp32


@pytest.mark.slow  # the default suite kills and resumes FSDP ranks in tests/chaos/test_multinode.py
def test_fsdp_trainer_killed_and_resumed_trains_every_rollout_once(tmp_path, tiny_model_dir, redis_server, run_id):
    """The trainer service under torchrun with FSDP on 2 gloo ranks, SIGKILLed (the whole process
    group) after step 1 and in the middle of step 3, then run to the end: the ledger lists every
    rollout once, the checkpoint (gathered from the shards) holds them all, versions continue."""
    import asyncio
    import os
    import signal
    import subprocess
    import sys

    from redis.asyncio import Redis

    from shared.runstore.ledger import Ledger
    from tests.helpers import publish
    from tests.integration.test_trainer import TRAINER_ENV

    rollouts = recorded_rollouts(tiny_model_dir, 24, seed=87)  # 6 steps of 4 prompts
    env = {
        **os.environ,
        **TRAINER_ENV,
        "STEADYRL_TRAINER_MODEL_PATH": str(tiny_model_dir),
        "STEADYRL_TRAINER_OUT_DIR": str(tmp_path / "trainer"),
        "STEADYRL_TRAINER_REDIS_URL": redis_server.url,
        "STEADYRL_TRAINER_RUN_ID": run_id,
        "STEADYRL_TRAINER_MAX_STEPS": "6",
        "STEADYRL_TRAINER_PARALLEL__MODE": "fsdp",
        "STEADYRL_TRAINER_COMPUTE__MICRO_BATCH_TOKENS": "64",
        "STEADYRL_LOG_LEVEL": "INFO",
        "OMP_NUM_THREADS": "1",
    }

    def torchrun():
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "services.trainer",
        ]

    async def main():
        redis = Redis.from_url(redis_server.url)
        # rollouts arrive two steps at a time, so each kill falls before the end of the run
        for part, marker in enumerate(("event=step step=1 ", "event=step_started step=3 ")):
            await publish(redis, run_id, rollouts[part * 32 : (part + 1) * 32])
            trainer = await asyncio.create_subprocess_exec(
                *torchrun(), env=env, stderr=subprocess.PIPE, start_new_session=True
            )
            seen = []
            while marker not in (line := (await trainer.stderr.readline()).decode()):
                seen.append(line)
                assert line, "the trainer exited before the marker:\n" + "".join(seen[-40:])
            os.killpg(trainer.pid, signal.SIGKILL)  # torchrun and both ranks
            await trainer.wait()
        await publish(redis, run_id, rollouts[64:])
        final = subprocess.run(torchrun(), env=env, timeout=300, capture_output=True, text=True)
        ledger = await Ledger(redis, run_id).trained()
        await redis.aclose()
        return final, ledger

    final, ledger = asyncio.run(asyncio.wait_for(main(), 600))
    assert final.returncode == 0, final.stderr[-3000:]
    assert "parallel=fsdp" in final.stderr and "event=resumed checkpoint=step-0000000" in final.stderr
    assert len(ledger) == len(set(ledger)) == len(rollouts)  # no duplicate, no gap
    state = json.loads((tmp_path / "trainer" / "checkpoints" / "step-00000006" / "state.json").read_text())
    assert state["version"] == 6 and len(state["consumed"]) == len(rollouts)
    lines = [json.loads(line)["step"] for line in (tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3, 4, 5, 6]  # one line per step trained: the killed ones' extra lines cut by rank 0
    weights = load_model_weights(tmp_path / "trainer" / "checkpoints" / "step-00000006")
    assert set(weights) == set(load_causal_lm(tiny_model_dir, "float32").state_dict())  # whole, not a shard


def test_activation_checkpointing_keeps_the_replayed_routing_in_the_recompute(tiny_model_dir):
    """With each decoder layer recomputed in the backward, R2/R3 replay must hold there too (else
    the recomputed forward routes freely and the gradient is another model's): the update equals
    the one without checkpointing."""
    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=89)
    results = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = load_causal_lm(tiny_model_dir, "float32")
        routing = RoutingController(model)
        settings = TrainerSettings(model_path=str(tiny_model_dir), compute={"activation_checkpointing": checkpointing})
        wrapped = prepare(model, settings, torch.device("cpu"), 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)  # large: a routing change would show
        for replay in ("r3", "r2"):
            train_step(
                wrapped, optimizer, routing, collate(rollouts), GROUP, StepConfig(mini_batches=2, replay=replay), 0
            )
        results[checkpointing] = model.state_dict()
    assert model.is_gradient_checkpointing
    worst = worst_difference(results[False], results[True])
    print(f"activation checkpointing vs none (R3 then R2, 2 mini-batches each): max |Δparam| {worst:.2e}")
    assert worst <= 1e-6


def gathered_worker(rank: int, world: int, port: int, model_dir: str, shm_dir: str, out: str) -> None:
    """Rank 0 publishes a sharded model through a GatheredView — digests, a shm file, and a pass
    a transport abandoned half-way — while rank 1 follows its gather commands as the trainer does."""
    from pathlib import Path

    from services.trainer.parallel import GatheredView, gather_published
    from shared.runtime.distributed import broadcast_payloads
    from shared.weightsync.manifest import describe
    from shared.weightsync.shm import read_shm, write_shm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = load_causal_lm(model_dir, "float32")
    prepare(
        model,
        TrainerSettings(model_path=model_dir, parallel={"mode": "fsdp"}, compute={"precision": "fp32"}),
        torch.device("cpu"),
        world,
    )
    if rank == 0:
        view = GatheredView(model.state_dict(), torch.bfloat16, lambda: broadcast_payloads([], -3))
        digests = describe(view, 1, 0)
        manifest = write_shm(Path(shm_dir) / "v1.safetensors", view, 1, 0)
        for name, _ in zip(view, range(3), strict=False):  # a transport that failed after 3 tensors
            view[name]
        half_way = view.next
        view.finish()
        broadcast_payloads(None)  # the followers stop
        model_state, _ = full_state(model, torch.optim.AdamW(model.parameters()))
        expected = describe(CastView(model_state, torch.bfloat16), 1, 0)
        written = read_shm(Path(shm_dir) / "v1.safetensors", manifest)  # every digest checked
        with open(out, "w") as f:
            json.dump(
                {
                    "passes": view.passes,
                    "half_way": half_way,
                    "after": view.next,
                    "same_digests": [t.checksum for t in digests.tensors]
                    == [t.checksum for t in expected.tensors]
                    == [t.checksum for t in manifest.tensors],
                    "names": list(written) == [t.name for t in expected.tensors],
                    "dtypes": sorted({t.dtype for t in manifest.tensors}),
                },
                f,
            )
    else:
        gathers = 0
        while True:  # StepRunner.follow's GATHER branch
            payloads, tag = broadcast_payloads(None)
            if payloads is None:
                break
            gather_published(model.state_dict())
            gathers += 1
        assert gathers == 3, gathers
        full_state(model, torch.optim.AdamW(model.parameters()))
    exit_rank()


def test_a_sharded_model_publishes_tensor_by_tensor_with_every_rank_gathering(tmp_path, tiny_model_dir):
    """FSDP on 2 gloo ranks: rank 0's published version (digests, then a shm file) is gathered one
    tensor at a time as the transport reads it, no full copy kept, and is the bf16 cast of the
    model's full state exactly; a pass cut short is completed, so no rank waits on a gather."""
    out = tmp_path / "gathered.json"
    mp.start_processes(
        gathered_worker,
        args=(2, free_port(), str(tiny_model_dir), str(tmp_path), str(out)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    result = json.loads(out.read_text())
    assert result["passes"] == 3 and result["half_way"] == 3 and result["after"] == 0
    assert result["same_digests"] and result["names"] and result["dtypes"] == ["bfloat16"]


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_every_objective_trains_the_moe_with_the_corrections_and_r3(tiny_model_dir, objective):
    """GSPO and CISPO through the whole step on the tiny MoE, N = 2 with R3 replay and a KL in the
    loss: the weights move, every diagnostic is finite, the replayed routing agrees with the traces."""
    rollouts = recorded_rollouts(tiny_model_dir, 4, seed=91)
    config = StepConfig(loss=LossConfig(objective=objective, kl_coef=0.01), mini_batches=2, replay="r3")
    start = load_causal_lm(tiny_model_dir, "float32").state_dict()
    model, metrics = step(tiny_model_dir, rollouts, config, reference_dir=str(tiny_model_dir))
    moved = worst_difference(start, model.state_dict())
    print(f"{objective}: moved {moved:.2e}; " + ", ".join(f"{k} {metrics[k]:.3g}" for k in sorted(metrics)[:12]))
    assert moved > 1e-4
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
    assert metrics["routing_agreement"] > 0.9 and 0 <= metrics["clip_frac"] <= 1
    assert metrics["ref_kl"] >= 0 and "is_weight_max" in metrics


def test_distillation_trains_on_the_teacher_s_per_token_advantage(tiny_model_dir):
    """Rewards all equal (no task signal) and a teacher at half the sampler's logprob (the gap
    −½ log μ(y_t) > 0 on every token): the step moves the weights on the teacher's signal alone, its
    `teacher_gap` the mean by hand."""
    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=93)
    for r in rollouts:
        r.reward = 1.0
        r.teacher_logprobs = (0.5 * r.inference_logprobs).astype(np.float32)
    gap = np.concatenate([-0.5 * r.inference_logprobs for r in rollouts]).mean()
    plain, _ = step(tiny_model_dir, rollouts, StepConfig())  # equal rewards: only AdamW's weight decay
    model, metrics = step(tiny_model_dir, rollouts, StepConfig(distill_coef=1.0))
    assert worst_difference(plain.state_dict(), model.state_dict()) > 1e-4
    assert metrics["teacher_gap"] == pytest.approx(float(gap), rel=1e-5)


def test_distillation_on_the_teacher_s_top_k_lowers_the_kl_to_it(tiny_model_dir, tmp_path):
    """A teacher (the tiny model with seeded noise on every weight) scores the rollouts' top 4 at each
    position through the torch engine; the top-k ride the wire, and a step on the loss alone (no
    sampled-token advantage, rewards equal) reports `teacher_kl` equal to the KL by hand under the
    model before the step, and leaves the model nearer the teacher: the same KL after it is lower (at
    lr 1e-4: AdamW's first step moves every weight by about lr, at 3e-3 past the teacher)."""
    from shared.core.distillation import top_k_kl
    from shared.engines import make_engine

    teacher = make_engine("torch", perturbed_model(tiny_model_dir, tmp_path / "teacher"), "float32")
    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=95)
    try:
        scored = teacher.score([(r.prompt_token_ids.tolist(), r.completion_token_ids.tolist()) for r in rollouts], 4)
    finally:
        teacher.close()
    for r, s in zip(rollouts, scored, strict=True):
        r.reward = 1.0
        r.teacher_logprobs = np.asarray(s.logprobs, dtype=np.float32)
        r.teacher_top_ids = np.asarray(s.top_ids, dtype=np.int32)
        r.teacher_top_logprobs = np.asarray(s.top_logprobs, dtype=np.float32)
    rollouts = [decode_rollout(encode_rollout(r)) for r in rollouts]
    batch = collate(rollouts)
    assert batch.teacher_top_ids.shape == (*batch.loss_mask.shape, 4)

    def kl_of(model) -> float:
        with torch.no_grad():
            forward = sequence_logprobs(model, batch, teacher_top=True)
            kl = top_k_kl(forward.top_logprobs, batch.teacher_top_logprobs)
        return float(kl[batch.loss_mask].mean())

    before = kl_of(load_causal_lm(tiny_model_dir, "float32"))
    model, metrics = step(tiny_model_dir, rollouts, StepConfig(distill_top_k_coef=1.0), lr=1e-4)
    assert metrics["teacher_kl"] == pytest.approx(before, rel=1e-4)
    after = kl_of(model)
    assert before > 0.05 and after < 0.97 * before, (before, after)  # 0.163 → 0.140
