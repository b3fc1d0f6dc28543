"""LoRA on the trainer's model with `peft`: the adapter is what trains (the base is frozen, the
router too: it is never a target), and what a version publishes is the base with the adapter
merged in, named as the base model names its tensors, so every transport and engine takes it as
it takes a full version.

Targets: the attention projections (`target_modules`) and, where the architecture keeps its
experts as stacked parameters (transformers' Qwen3-MoE: `mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), the experts (`target_experts`, through peft's `target_parameters`;
dropout must then be 0, as peft requires)."""

from __future__ import annotations

import torch
from torch import nn

ADAPTER = "default"
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str],
               target_experts: bool) -> nn.Module:
    """`model` wrapped by peft with a fresh adapter (B = 0: the merged model equals the base)."""
    from peft import LoraConfig, get_peft_model

    experts = [name for name in EXPERT_PARAMETERS if any(n.endswith(name) for n, _ in model.named_parameters())] \
        if target_experts else []
    if target_experts and not experts:
        raise ValueError("trainer.lora.target_experts: this architecture keeps no stacked expert parameters "
                         f"({', '.join(EXPERT_PARAMETERS)})")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        target_parameters=experts or None, bias="none")
    return get_peft_model(model, config)


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (the model itself when not wrapped)."""
    return model.base_model.model if hasattr(model, "peft_config") else model


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict, each adapted tensor with its adapter merged in (W + ΔW),
    under the base model's names; detached."""
    from peft.tuners.lora import LoraLayer

    inner = base_model(model)
    deltas: dict[str, torch.Tensor] = {}
    for name, module in inner.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            parameter = getattr(module, "parameter_name", None) or "weight"
            deltas[f"{_clean(name)}.{parameter}"] = module.get_delta_weight(ADAPTER).detach()
    out = {}
    with torch.no_grad():
        for name, tensor in inner.state_dict().items():
            if ".lora_" in name:
                continue
            key = _clean(name)
            out[key] = tensor + deltas[key] if key in deltas else tensor.detach()
    missing = set(deltas) - set(out)
    if missing:
        raise RuntimeError(f"adapter deltas without a base tensor: {sorted(missing)[:3]}")
    return out


def _clean(name: str) -> str:
    return name.replace(".base_layer", "")
