"""Weights from the trainer to the replicas, one package: `base.py` (what a transport is, and
the registry of them), the manifest (versions, digests), the trainer's signature (`signing.py`),
the gRPC wire format (`frames.py`), and one module per transport holding both its ends and its
vLLM-worker reader — `grpc` (push to the weight-sync service, pull from it), `shm` (a file in
shared memory), `collective` (a gloo / nccl broadcast) — and the replica's watch
(`subscriber.py`). The weight-sync service is the control plane of every transport: announce,
membership, late joiners, the gRPC fallback, the signature's check."""

from shared.weightsync.base import TRANSPORTS, TransportName, make_publisher

__all__ = ["TRANSPORTS", "TransportName", "make_publisher"]
