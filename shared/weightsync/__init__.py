"""Weights from the trainer to the replicas, one package: `base.py` (what a transport is, and
the registry of them), the manifest (versions, digests), the trainer's signature (`signing.py`),
the gRPC wire format (`frames.py`), and one module per transport holding both its ends and its
vLLM-worker reader — `grpc` (push to the weight-sync service, pull from it), `shm` (a file in
shared memory), `collective` (a gloo / nccl broadcast) — and the replica's watch
(`subscriber.py`). The weight-sync service is the control plane of every transport: announce,
membership, late joiners, the gRPC fallback, the signature's check."""

from __future__ import annotations

from pathlib import Path

from shared.weightsync.base import TRANSPORTS, PublishOptions, TransportName, WeightPublisher, transport

__all__ = ["TRANSPORTS", "TransportName", "make_publisher"]


def make_publisher(
    name: str,
    address: str,
    signer=None,
    max_message_bytes: int | None = None,
    shm_dir: Path | None = None,
    shm_keep: int = 4,
    patches: bool = False,
) -> WeightPublisher:
    """The trainer's publisher of the transport `name`, announcing through weight-sync at `address`."""
    from shared.weightsync.grpc import GrpcWeightPublisher

    chosen = transport(name)
    options = PublishOptions(signer, max_message_bytes, shm_dir, shm_keep, patches)
    extra = {"max_message_bytes": max_message_bytes} if max_message_bytes else {}
    return chosen.publisher(GrpcWeightPublisher(address, signer=signer, **extra), options)
