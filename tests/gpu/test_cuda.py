"""What only a GPU can show: the trainer's step on CUDA (bf16-mixed) against the same step on the
CPU, and FSDP over nccl. Skipped without CUDA (never a faked GPU); run on a machine with one."""

import pytest
import torch
import torch.multiprocessing as mp

from services.trainer.batch import collate
from services.trainer.forward import Compute
from services.trainer.global_step import StepConfig, train_step
from shared.models import load_causal_lm
from shared.models.routing import RoutingController
from shared.rollouts.record import encode_rollout
from shared.runstore.redis_server import free_port
from tests.integration.test_trainer import GROUP, recorded_rollouts

pytestmark = pytest.mark.gpu
LR = 1e-4


def one_step(model_dir, rollouts, device: str, autocast=None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = load_causal_lm(model_dir, "float32").to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    train_step(
        model,
        optimizer,
        RoutingController(model),
        collate(rollouts),
        GROUP,
        StepConfig(replay="r3"),
        0,
        compute=Compute(torch.device(device), autocast),
    )
    return {k: v.cpu() for k, v in model.state_dict().items()}


def test_a_step_on_cuda_matches_the_cpu(tiny_model_dir):
    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=91)
    cpu = one_step(tiny_model_dir, rollouts, "cpu")
    cuda = one_step(tiny_model_dir, rollouts, "cuda")
    bf16 = one_step(tiny_model_dir, rollouts, "cuda", torch.bfloat16)
    start = load_causal_lm(tiny_model_dir, "float32").state_dict()

    def update(state: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([(state[k] - v).flatten() for k, v in start.items()])

    # fp32 on two devices: the same update up to the order of float sums. AdamW's first step is
    # lr × g / (|g| + eps), so a weight whose gradient is at rounding level can move by up to lr
    # either way: measured on an H100, max |Δ| 1.08e-5 = 0.11 × lr, cosine of the updates > 0.9999.
    cosine = {
        name: float(torch.nn.functional.cosine_similarity(update(cpu), update(other), dim=0))
        for name, other in (("cuda", cuda), ("bf16", bf16))
    }
    print(
        f"one step, cpu vs cuda: max |Δ param| {max(float((cpu[k] - cuda[k]).abs().max()) for k in cpu):.3e}, "
        f"cosine of the updates {cosine}"
    )
    assert max(float((cpu[k] - cuda[k]).abs().max()) for k in cpu) <= 0.2 * LR
    assert cosine["cuda"] >= 0.9999 and cosine["bf16"] >= 0.9


def nccl_worker(rank: int, world: int, port: int, model_dir: str, data: list[bytes], out: str) -> None:
    from tests.integration.test_scale import fsdp_worker

    torch.cuda.set_device(rank)
    fsdp_worker(rank, world, port, model_dir, data, out, "r2", "fsdp", f"cuda:{rank}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP over nccl needs 2 GPUs")
def test_fsdp_over_nccl_updates_like_one_process(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    rollouts = recorded_rollouts(tiny_model_dir, 4, seed=93)
    out = str(tmp_path / "nccl.safetensors")
    mp.start_processes(
        nccl_worker,
        args=(2, free_port(), str(tiny_model_dir), [encode_rollout(r) for r in rollouts], out),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dir, "float32").train()
    train_step(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        RoutingController(model),
        collate(rollouts),
        GROUP,
        StepConfig(mini_batches=2, replay="r2"),
        0,
    )
    sharded = load_file(out)
    assert max(float((model.state_dict()[k] - sharded[k].cpu()).abs().max()) for k in sharded) <= 1e-4


def test_the_torch_engine_on_cuda_serves_what_it_does_on_the_cpu(tiny_model_dir):
    """fp32 greedy on both devices: the same tokens, logprobs and routing, before and after a
    weight update handed over as host tensors; seeded sampling repeats on the GPU."""
    from shared.engines import Sampling, make_engine
    from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts

    prompts = encode_prompts(char_tokenizer(), [e.prompt for e in TinySpec().task(seed=2).split("eval", 32)])
    greedy = Sampling(temperature=0, max_new_tokens=6)
    engines = {
        device: make_engine("torch", str(tiny_model_dir), "float32", device=device) for device in ("cpu", "cuda")
    }
    try:
        assert engines["cuda"].model.device.type == "cuda" and "on cuda" in engines["cuda"].capabilities.notes[-1]
        torch.manual_seed(0)
        moved = {
            k: v + 0.01 * torch.randn_like(v) for k, v in load_causal_lm(tiny_model_dir, "float32").state_dict().items()
        }
        for version in (0, 1):
            if version:
                for engine in engines.values():
                    engine.update_weights(1, moved)
            out = {d: e.generate(prompts, greedy, return_trace=True) for d, e in engines.items()}
            same = [i for i in range(len(prompts)) if out["cpu"][i].token_ids == out["cuda"][i].token_ids]
            assert len(same) >= 0.9 * len(prompts)
            gap = max(
                abs(a - b) for i in same for a, b in zip(out["cpu"][i].logprobs, out["cuda"][i].logprobs, strict=True)
            )
            assert gap <= 1e-4
            traces = [(out["cpu"][i].routing_trace == out["cuda"][i].routing_trace).all(-1).mean() for i in same]
            assert min(traces) >= 0.95
            assert {v for s in out["cuda"] for v in s.versions} == {version}
            print(
                f"torch engine, cpu vs cuda, version {version}: {len(same)}/{len(prompts)} identical, "
                f"max |Δ logprob| {gap:.2e}, routing agreement {sum(traces) / len(traces):.4f}"
            )
        seeded = Sampling(temperature=1.0, max_new_tokens=6, seed=7)
        first, again = (engines["cuda"].generate(prompts[:8], seeded) for _ in range(2))
        assert [s.token_ids for s in first] == [s.token_ids for s in again]
    finally:
        for engine in engines.values():
            engine.close()


def test_eval_on_cuda_scores_what_it_does_on_the_cpu(tiny_model_dir):
    import json
    import subprocess
    import sys

    def accuracy(device: str) -> dict:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "steadyrl.cli",
                "eval",
                str(tiny_model_dir),
                "--size",
                "64",
                "--samples",
                "0",
                "--device",
                device,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cpu = accuracy("cpu")
    cuda = accuracy("cuda")
    assert (cpu["device"], cuda["device"]) == ("cpu", "cuda") and cuda["accuracy"] == cpu["accuracy"] > 0


def test_exact_mode_on_cuda_every_token_bit_for_bit(tiny_model_dir):
    """Exact mode with the torch engine and the trainer's forward both on CUDA: the kernel check on
    the device, then every sampled token's logprob against the trainer's recompute in another batch
    layout, bit for bit (docs/guides/exact.md: what a GPU run of exact mode needs)."""
    from services.trainer.forward import sequence_logprobs
    from shared.engines import Sampling, make_engine
    from shared.models import batch_invariant
    from tests.integration.test_inference import prompts_of

    engine = make_engine("torch", str(tiny_model_dir), "float32", device="cuda", max_num_seqs=5, exact=True)
    prompts = prompts_of(12, seed=3)
    prompts[2], prompts[7] = prompts[2][2:], prompts[7][:3]
    futures = [
        engine.start(p, Sampling(temperature=1.0, max_new_tokens=4 + 3 * (i % 4), seed=11), index=i)
        for i, p in enumerate(prompts)
    ]
    samples = [f.result(120) for f in futures]
    engine.close()
    model = load_causal_lm(tiny_model_dir, "float32").to("cuda")
    batch_invariant.prepare(model)
    batch_invariant.check_kernels(model, "cuda")
    rollouts = []
    for i, (prompt, sample) in enumerate(zip(prompts, samples, strict=True)):
        rollouts += recorded_like(f"t{i}", prompt, sample)
    batch = collate(rollouts).to("cuda")
    with torch.no_grad():
        logprobs = sequence_logprobs(model, batch, compute=Compute(torch.device("cuda"), exact=True)).logprobs.cpu()
    mask = batch.loss_mask.cpu()
    differing = int(((logprobs != batch.inference_logprobs.cpu()) & mask).sum())
    print(f"exact on cuda: {differing} of {int(mask.sum())} tokens differ")
    assert differing == 0


def recorded_like(task_id: str, prompt: list[int], sample) -> list:
    from shared.rollouts.record import RolloutTimings
    from shared.rollouts.samples import rollouts_from_samples
    from shared.rpc.steadyrl.v1 import common_pb2

    task = common_pb2.PromptTask(task_id=task_id, prompt_token_ids=prompt)
    return rollouts_from_samples(task, [sample], [0.0], "gpu", "torch", RolloutTimings())


def test_patch_versions_into_a_cuda_torch_engine_bit_for_bit(tmp_path, tiny_model_dir):
    """Patch versions by shm into the torch engine on CUDA: each patch applied on the device in place,
    the engine's weights after every version the published bytes (docs/internals/weights.md)."""
    import asyncio

    from shared.engines import make_engine
    from shared.weightsync import make_publisher
    from shared.weightsync.manifest import CastView
    from tests.integration.test_patch_versions import gone, held, published, step, subscriber, until
    from tests.integration.test_weightsync import Server

    master = {k: v.detach().clone() for k, v in load_causal_lm(tiny_model_dir, "float32").state_dict().items()}
    engine = make_engine("torch", str(tiny_model_dir), "bfloat16", device="cuda")
    generator = torch.Generator().manual_seed(0)

    async def main():
        server = Server(tmp_path, shm_dir=tmp_path / "shm")
        await server.start()
        watch = subscriber(server, engine, server.settings.verify_key_file, "shm")
        task = asyncio.create_task(watch.run())
        await until(lambda: len(server.servicer.members.subscribers) == 1)  # watching before version 1
        publisher = make_publisher("shm", server.address, server.signer, shm_dir=tmp_path / "shm" / "run", patches=True)
        differing = []
        try:
            for version in range(1, 13):
                if version > 1:
                    step(master, version, generator)
                await publisher.push(CastView(master, torch.bfloat16), version, version - 1, timeout=60)
                await until(lambda v=version: watch.version == v)
                if held(engine) != published(master):
                    differing.append(version)
        finally:
            await gone(task)
            await publisher.close()
            await server.stop()
        return watch, differing

    watch, differing = asyncio.run(asyncio.wait_for(main(), 240))
    engine.close()
    print(f"patch versions on cuda: {len(differing)} of 12 differ; received {watch.received}, whole {watch.whole}")
    assert differing == [] and watch.received == {"shm": 12} and watch.whole == 0
