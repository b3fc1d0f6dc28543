"""The FP8 emulation against FP8 kernels: the tiny MoE's answer logprobs with every FP8 matmul
run as an e4m3 GEMM (`torch._scaled_mm`, row-wise scales, fp32 accumulation), against the
emulation the torch engine runs (weights and inputs rounded through e4m3, computed in bf16) and
against plain bf16 — on the CPU (torch's CPU kernel), and on a GPU of compute capability 8.9 or
later (the `gpu` case, skipped without CUDA: never faked)."""

import contextlib

import pytest
import torch
from torch import nn

from shared.models import load_causal_lm
from shared.models.quantization import (
    FP8,
    FP8_MAX,
    QuantizedActivations,
    quantize_,
    quantized_targets,
)


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] → (e4m3 values, fp32 scale per row [M, 1])."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return (x / scale).to(FP8), scale


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ as one real FP8 GEMM, in x's dtype (rows padded to 16)."""
    rows = x.shape[0]
    xq, sx = _rowwise(nn.functional.pad(x, (0, 0, 0, (-rows) % 16)))
    wq, sw = _rowwise(weight)
    return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t(), out_dtype=x.dtype)[:rows]


class RealFP8(QuantizedActivations):
    """The matmuls QuantizedActivations reaches, computed by FP8 kernels instead."""

    def quantized_matmul(self, func, args: tuple, kwargs: dict):
        x = args[0]
        weight = args[1]
        if func is nn.functional.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = fp8_gemm(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias
        offsets = (args[2] if len(args) > 2 else kwargs["offs"]).tolist()  # weight: [E, K, N] view
        out = x.new_zeros(x.shape[0], weight.shape[-1])
        start = 0
        for expert, end in enumerate(offsets):
            if end > start:
                out[start:end] = fp8_gemm(x[start:end], weight[expert].t())
            start = end
        return out


def answer_logprobs(model, ids, answer, mode=None) -> torch.Tensor:
    with torch.no_grad(), mode or contextlib.nullcontext():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[answer]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_fp8_emulation_tracks_fp8_kernels(tiny_model_dir, device):
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9 or later")
    from shared.kit.tiny import KitTask, sft_batch
    from shared.models.loading import load_tokenizer

    task = KitTask("arith")
    ids, labels = sft_batch(load_tokenizer(tiny_model_dir), task.task(task.spec(), 0).split("eval", 256))
    ids = ids.to(device)
    answer = (labels[:, 1:] != -100).to(device)
    reference = answer_logprobs(load_causal_lm(tiny_model_dir, "float32", device), ids, answer)
    plain = answer_logprobs(load_causal_lm(tiny_model_dir, "bfloat16", device), ids, answer)
    model = load_causal_lm(tiny_model_dir, "bfloat16", device)
    names = quantized_targets(model)
    quantize_(model, names, "fp8")
    params = [dict(model.named_parameters())[n] for n in names]
    emulated = QuantizedActivations(params)
    real = RealFP8(params)
    by = {"emulated": answer_logprobs(model, ids, answer, emulated), "real": answer_logprobs(model, ids, answer, real)}
    assert emulated.matched == emulated.storages and real.matched == real.storages  # experts included

    def gap(a, b) -> float:
        return float((a - b).abs().mean())

    figures = {
        "emulated_vs_real": gap(by["emulated"], by["real"]),
        "bf16_vs_real": gap(plain, by["real"]),
        "real_vs_fp32": gap(by["real"], reference),
        "emulated_vs_fp32": gap(by["emulated"], reference),
        "bf16_vs_fp32": gap(plain, reference),
        "tokens": int(answer.sum()),
    }
    print(f"fp8 kernels on {device}, mean |Δ answer logprob|:", figures)
    # the emulation lands where the kernels do: nearer them than bf16 is, and as far from fp32
    assert figures["emulated_vs_real"] < 0.75 * figures["bf16_vs_real"]
    assert 0.8 <= figures["emulated_vs_fp32"] / figures["real_vs_fp32"] <= 1.25
