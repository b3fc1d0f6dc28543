"""LoRA RL on the tiny MoE, by hand: one step's adapter update equals AdamW's first step on the
gradient of B that the chain rule gives from the full model's weight gradient (∂L/∂B = s · ∂L/∂W ·
Aᵀ, ∂L/∂A = 0 while B = 0); the published (merged) weights change by s · B A exactly; the router
and every base weight stay frozen; the merged model computes what the adapted one computes."""

import numpy as np
import pytest
import torch

from services.trainer.batch import collate
from services.trainer.global_step import StepConfig, train_step
from shared.models import load_causal_lm
from shared.models.lora import apply_lora, merged_state
from shared.rollouts.record import Rollout

GROUP = 2
LR = 1e-3
EPS = 1e-8


def rollouts() -> list[Rollout]:
    rng = np.random.default_rng(0)
    out = []
    for index, reward in enumerate((1.0, 0.0)):
        tokens = rng.integers(5, 40, 6)
        out.append(
            Rollout(
                rollout_id=f"g:{index}",
                group_id="g",
                prompt_token_ids=np.array([1, 7, 8], dtype=np.int32),
                completion_token_ids=tokens.astype(np.int32),
                inference_logprobs=-rng.uniform(0.5, 3.0, 6).astype(np.float32),
                policy_versions=np.zeros(6, dtype=np.uint64),
                reward=reward,
                sample_index=index,
                group_size=GROUP,
                task_id="g",
            )
        )
    return out


class Recorder(torch.optim.Optimizer):
    """Keeps each parameter's gradient at its step instead of stepping."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads: dict[int, torch.Tensor] = {}

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.grads[id(p)] = p.grad.detach().clone()


CONFIG = StepConfig(grad_clip=0.0)


def test_one_lora_step_equals_the_update_by_hand(tiny_model_dir):
    torch.manual_seed(0)
    base = load_causal_lm(tiny_model_dir, "float32").train()
    recorder = Recorder(base.parameters())
    train_step(base, recorder, None, collate(rollouts()), GROUP, CONFIG, version=0)
    weight_grads = {name: recorder.grads[id(p)] for name, p in base.named_parameters() if id(p) in recorder.grads}

    model = apply_lora(
        load_causal_lm(tiny_model_dir, "float32"),
        rank=4,
        alpha=8.0,
        dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        target_experts=False,
    ).train()
    before = {k: v.clone() for k, v in merged_state(model).items()}
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable) and not any("gate" in n for n in trainable)
    a0 = {n: p.detach().clone() for n, p in trainable.items() if "lora_A" in n}
    optimizer = torch.optim.AdamW(list(trainable.values()), lr=LR, eps=EPS, weight_decay=0.0)
    train_step(model, optimizer, None, collate(rollouts()), GROUP, CONFIG, version=0)
    after = merged_state(model)
    scale = 8.0 / 4
    checked = 0
    for name, tensor in after.items():
        delta = tensor - before[name]
        if not name.endswith(("q_proj.weight", "v_proj.weight")):
            assert not delta.any(), name  # the base, the router and every other weight: frozen
            continue
        prefix = "base_model.model." + name.removesuffix(".weight")
        a = a0[f"{prefix}.lora_A.default.weight"]
        grad_b = scale * weight_grads[name] @ a.T  # chain rule at B = 0
        b1 = -LR * grad_b / (grad_b.abs() + EPS)  # AdamW's first step: m̂ = g, v̂ = g²
        torch.testing.assert_close(
            dict(model.named_parameters())[f"{prefix}.lora_A.default.weight"], a, rtol=0, atol=0
        )  # ∂L/∂A = 0 while B = 0
        torch.testing.assert_close(delta, scale * b1 @ a, rtol=1e-4, atol=1e-7)
        checked += 1
    assert checked == 4  # q and v of 2 layers


def test_the_merged_weights_compute_what_the_adapter_computes(tiny_model_dir):
    """With the experts adapted too (peft's target_parameters on the stacked expert tensors)."""
    torch.manual_seed(1)
    model = apply_lora(
        load_causal_lm(tiny_model_dir, "float32"),
        rank=4,
        alpha=8.0,
        dropout=0.0,
        target_modules=["q_proj", "o_proj"],
        target_experts=True,
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained adapter, not the zero it starts from
    assert any("experts" in n for n, p in model.named_parameters() if p.requires_grad)
    plain = load_causal_lm(tiny_model_dir, "float32").eval()
    state = merged_state(model)
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state)
    ids = torch.tensor([[1, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_experts_without_a_stacked_form_are_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(ValueError, match="no stacked expert parameters"):
        apply_lora(dense, 4, 8.0, 0.0, ["q_proj"], target_experts=True)


def test_a_lora_trainer_resumes_its_adapter_and_optimizer_from_its_checkpoint(tmp_path, tiny_model_dir):
    """StepRunner with trainer.lora: the optimizer holds the adapter alone, a checkpoint holds the
    adapter and AdamW's state (no base weight), and a new trainer resumes both exactly; its
    published weights are the merged ones under the base model's names."""
    from services.trainer.checkpoint import TrainerState
    from services.trainer.config import TrainerSettings
    from services.trainer.model_runner import StepRunner

    settings = TrainerSettings(
        model_path=str(tiny_model_dir),
        out_dir=tmp_path,
        batch_prompts=1,
        group_size=GROUP,
        lora={"rank": 4, "target_modules": ["q_proj"], "publish": "merged"},
        checkpoint={"async_save": False},
    )
    runner = StepRunner(settings)
    assert sum(p.numel() for g in runner.optimizer.param_groups for p in g["params"]) == 2 * (
        4 * 64 + 64 * 4
    )  # A and B of q_proj, 2 layers
    runner.step(rollouts(), 0)
    runner.save(TrainerState(step=1, version=1)).finish()
    adapter = {n: p.detach().clone() for n, p in runner.model.named_parameters() if p.requires_grad}
    moments = {
        n: runner.optimizer.state[p]["exp_avg"].clone() for n, p in runner.model.named_parameters() if p.requires_grad
    }
    published = dict(runner.weights().items())
    assert set(published) == set(load_causal_lm(tiny_model_dir, "float32").state_dict())

    again = StepRunner(settings)
    state = again.restore()
    assert (state.step, state.version) == (1, 1)
    for name, p in again.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.detach(), adapter[name], rtol=0, atol=0)
            torch.testing.assert_close(again.optimizer.state[p]["exp_avg"], moments[name], rtol=0, atol=0)
    for name, tensor in again.weights().items():
        torch.testing.assert_close(tensor, published[name], rtol=0, atol=0)
    from steadyrl.report import export_checkpoint

    checkpoint = tmp_path / "checkpoints" / "step-00000001"
    export_checkpoint(str(tiny_model_dir), checkpoint, tmp_path / "adapter", merge=False)  # the adapter alone
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    merged = load_causal_lm(
        str(export_checkpoint(str(tiny_model_dir), checkpoint, tmp_path / "merged", merge=True)), "float32"
    ).state_dict()
    for name, tensor in published.items():  # --merge: the base with the adapter merged in, as published
        torch.testing.assert_close(merged[name].to(tensor.dtype), tensor, rtol=0, atol=0)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lora": {"rank": 8, "target_experts": True, "dropout": 0.1}}, "dropout must be 0 with target_experts"),
        (
            {"lora": {"rank": 8, "publish": "merged"}, "parallel": {"mode": "fsdp", "ranks": 2}},
            "publish = 'merged' with trainer",
        ),
        ({"lora": {"rank": -1}}, "greater than or equal to 0"),
        ({"lora": {"rank": 8, "alpha": 0}}, "greater than 0"),
    ],
)
def test_bad_lora_settings_are_refused_before_anything_starts(fields, message, tiny_model_dir):
    from pydantic import ValidationError

    from services.trainer.config import TrainerSettings

    with pytest.raises(ValidationError, match=message):
        TrainerSettings(model_path=str(tiny_model_dir), **fields)
