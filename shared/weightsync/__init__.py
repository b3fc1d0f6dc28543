"""Weights from the trainer to the replicas, one package: the manifest (versions, digests,
signature), the gRPC wire format, and one module per transport holding both its ends —
`grpc` (push to the weight-sync service, pull from it), `shm` (a file in shared memory),
`collective` (a gloo / nccl broadcast) — behind `WeightPublisher` and the subscriber. The
weight-sync service is the control plane of every transport: announce, membership, late joiners,
the gRPC fallback, signing."""

from __future__ import annotations

from pathlib import Path

from shared.interfaces import WeightPublisher

TRANSPORTS = ("grpc", "shm", "collective")


def make_publisher(
    kind: str,
    address: str,
    signer=None,
    max_message_bytes: int | None = None,
    shm_dir: Path | None = None,
    shm_keep: int = 4,
) -> WeightPublisher:
    """The publisher of a transport by name (`TRANSPORTS`)."""
    from shared.weightsync.collective import CollectiveWeightPublisher
    from shared.weightsync.grpc import GrpcWeightPublisher
    from shared.weightsync.shm import ShmWeightPublisher

    if kind not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {kind!r}; one of {TRANSPORTS}")
    if kind == "shm" and shm_dir is None:
        raise ValueError("the shm transport needs a directory in shared memory")
    options = {"max_message_bytes": max_message_bytes} if max_message_bytes else {}
    base = GrpcWeightPublisher(address, signer=signer, **options)
    wrap = {
        "grpc": lambda: base,
        "shm": lambda: ShmWeightPublisher(base, shm_dir, shm_keep),
        "collective": lambda: CollectiveWeightPublisher(base),
    }
    return wrap[kind]()
