"""LoRA on the trainer's model with `peft`: the adapter trains; the base, router included, is frozen.

A version publishes the adapter alone (`adapter_state`, which an engine adds to its base with `inject`) or, with
`trainer.lora.publish = "merged"`, the base with the adapter merged in under the base's names (`merged_state`), a
full version to every engine. Targets: the attention projections (`target_modules`) and, where the experts are
stacked parameters, the experts (`target_experts`; dropout must then be 0).

Details: docs/internals/engines.md"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import blake3
import torch
from torch import nn

ADAPTER = "default"
PREFIX = "base_model.model."  # PEFT's saved names: the base model's module path after it
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
SAME = ("r", "lora_alpha", "target_modules", "target_parameters", "use_rslora", "use_dora")  # what fixes the shapes
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def apply_lora(
    model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str], target_experts: bool
) -> nn.Module:
    """`model` wrapped by peft with a fresh adapter (B = 0: the merged model equals the base)."""
    from peft import LoraConfig, get_peft_model

    experts = (
        [name for name in EXPERT_PARAMETERS if any(n.endswith(name) for n, _ in model.named_parameters())]
        if target_experts
        else []
    )
    if target_experts and not experts:
        raise ValueError(
            "trainer.lora.target_experts: this architecture keeps no stacked expert parameters "
            f"({', '.join(EXPERT_PARAMETERS)})"
        )
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        target_parameters=experts or None,
        bias="none",
    )
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


@functools.lru_cache(maxsize=4)
def base_digest(model_path: str) -> bytes:
    """BLAKE3-256 over a model directory's weight files (names and bytes, in name order): what an
    adapter version names as its base, so a replica serving other weights refuses it."""
    files = sorted({f for pattern in WEIGHT_FILES for f in Path(model_path).glob(pattern)})
    if not files:
        raise ValueError(f"{model_path} holds no weight files ({', '.join(WEIGHT_FILES)}) to name the base by")
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for file in files:
        hasher.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(64 << 20):
                hasher.update(chunk)
    return hasher.digest()


def adapter_config_json(model: nn.Module) -> str:
    """The adapter's adapter_config.json, as peft writes it (sets as sorted lists)."""
    config = model.peft_config[ADAPTER].to_dict()
    return json.dumps(
        {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}, sort_keys=True, default=str
    )


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (`base_model.model.<module>.lora_A.weight`); detached."""
    from peft import get_peft_model_state_dict

    return {name: tensor.detach() for name, tensor in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}


def same_shape(a: str, b: str) -> bool:
    """Whether two adapter configs (JSON) make the same tensors: rank, alpha, targets."""
    x = json.loads(a)
    y = json.loads(b)
    norm = lambda v: sorted(v) if isinstance(v, list) else v  # noqa: E731
    return all(norm(x.get(k)) == norm(y.get(k)) for k in SAME)


def inject(model: nn.Module, config_json: str) -> dict[str, torch.Tensor]:
    """peft's LoRA layers of the adapter `config_json` put into `model` itself (the module keeps its
    class: B = 0, so it computes what it did); its adapter parameters by PEFT's saved names.
    ValueError when the config does not fit the model."""
    from peft import LoraConfig, inject_adapter_in_model

    config = json.loads(config_json)
    fields = set(LoraConfig.__dataclass_fields__)
    try:
        lora = LoraConfig(**{k: v for k, v in config.items() if k in fields and k not in ("peft_type", "task_type")})
        inject_adapter_in_model(lora, model, adapter_name=ADAPTER)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"the adapter does not fit the model: {exc}") from None
    return {PREFIX + name.replace(f".{ADAPTER}.", "."): p for name, p in model.named_parameters() if ".lora_" in name}


def adapter_refusal(base: bytes, config_json: str, model_path: str, served_json: str) -> str:
    """Why an engine serving `model_path` (and the adapter `served_json`, '' for none yet) must
    refuse an adapter version naming base `base` with config `config_json`; '' when it fits."""
    try:
        if not model_path:
            raise ValueError("no model directory")
        ours = base_digest(model_path)
    except (OSError, ValueError) as exc:
        return f"this replica's base cannot be named: {exc}"
    if base != ours:
        return f"an adapter for another base model (base {base.hex()[:12]}, this replica serves {ours.hex()[:12]})"
    if served_json and not same_shape(served_json, config_json):
        return (
            f"the adapter's rank or targets differ from those of the adapter served ({_shape(config_json)} vs "
            f"{_shape(served_json)})"
        )
    return ""


def _shape(config_json: str) -> str:
    config = json.loads(config_json)
    return f"r={config.get('r')}, targets={sorted(config.get('target_modules') or [])}"
