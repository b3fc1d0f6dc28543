"""What vLLM loads into each of its workers: the methods mixed into every worker (called by name
through `collective_rpc`), and, as vLLM imports this before the model loads, the worker's setup —
the `steadyrl` weight-transfer backend registered (`shared.weightsync.vllm_backend`) and, on the
CPU, MoE layers that no adapter targets kept on their own kernel
(`vllm_lora.plain_moe_without_expert_lora`)."""

from __future__ import annotations

from shared.engines.vllm_lora import plain_moe_without_expert_lora
from shared.weightsync.vllm_backend import register

register()
plain_moe_without_expert_lora()


class WorkerExtension:
    def steadyrl_update_status(self) -> dict:
        """What the last weight update did in this worker (`shared.weightsync.vllm_backend.Status`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return engine.status.as_dict() if engine is not None and hasattr(engine, "status") else {}

    def steadyrl_kept_digests(self) -> dict[str, str]:
        """BLAKE3 of each tensor whose published bytes this worker keeps (to patch them), hexadecimal:
        what a check holds against the version's manifest (`vllm_receiver.KeptVersion`)."""
        from shared.weightsync.manifest import digest

        engine = getattr(self, "weight_transfer_engine", None)
        kept = getattr(engine, "kept", None)
        return {name: digest(memoryview(data)).hex() for name, data in (kept.tensors if kept else {}).items()}
