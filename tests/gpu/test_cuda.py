"""What only a GPU can show: the trainer's step on CUDA (bf16-mixed) against the same step on the
CPU, and FSDP over nccl. Skipped without CUDA (never a faked GPU); run on a machine with one."""

import pytest
import torch
import torch.multiprocessing as mp

from shared.batch import collate
from shared.forward import Compute
from shared.models import load_causal_lm
from shared.models.routing import RoutingController
from shared.redis_server import free_port
from shared.rollout import encode_rollout
from shared.training import StepConfig, train_step
from tests.integration.test_trainer import GROUP, recorded_rollouts

pytestmark = pytest.mark.gpu


def one_step(model_dir, rollouts, device: str, autocast=None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = load_causal_lm(model_dir, "float32").to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, optimizer, RoutingController(model), collate(rollouts), GROUP, StepConfig(replay="r3"), 0,
               compute=Compute(torch.device(device), autocast))
    return {k: v.cpu() for k, v in model.state_dict().items()}


def test_a_step_on_cuda_matches_the_cpu(tiny_model_dir):
    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=91)
    cpu = one_step(tiny_model_dir, rollouts, "cpu")
    cuda = one_step(tiny_model_dir, rollouts, "cuda")
    bf16 = one_step(tiny_model_dir, rollouts, "cuda", torch.bfloat16)
    assert max(float((cpu[k] - cuda[k]).abs().max()) for k in cpu) <= 1e-5  # fp32 on two devices
    start = load_causal_lm(tiny_model_dir, "float32").state_dict()
    a = torch.cat([(cpu[k] - v).flatten() for k, v in start.items()])
    b = torch.cat([(bf16[k] - v).flatten() for k, v in start.items()])
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) >= 0.9


def nccl_worker(rank: int, world: int, port: int, model_dir: str, data: list[bytes], out: str) -> None:
    from tests.integration.test_scale import fsdp_worker

    torch.cuda.set_device(rank)
    fsdp_worker(rank, world, port, model_dir, data, out, "r2", "fsdp", f"cuda:{rank}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP over nccl needs 2 GPUs")
def test_fsdp_over_nccl_updates_like_one_process(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    rollouts = recorded_rollouts(tiny_model_dir, 4, seed=93)
    out = str(tmp_path / "nccl.safetensors")
    mp.start_processes(nccl_worker, args=(2, free_port(), str(tiny_model_dir), [encode_rollout(r) for r in rollouts],
                                          out), nprocs=2, join=True, start_method="spawn")
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dir, "float32").train()
    train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), RoutingController(model), collate(rollouts),
               GROUP, StepConfig(mini_batches=2, replay="r2"), 0)
    sharded = load_file(out)
    assert max(float((model.state_dict()[k] - sharded[k].cpu()).abs().max()) for k in sharded) <= 1e-4
