"""A trainer job's rendezvous at the weight-sync service, as torch.distributed sees it: `JobStore`, a
store over one round of the job's key space, reached through weight-sync's authenticated
Rendezvous RPCs (`services/weightsync/rendezvous.py`). torchrun's agents meet and assign ranks in
it (`job_rendezvous.py`), and the ranks form their process group in it (`rank_store`): no store
port anywhere, and nothing read from it is unpickled — its values are gloo's addresses, NCCL's
unique id, JSON and decimal counters.

Details: docs/guides/multi-node.md"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import grpc
import torch.distributed as dist

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.rpc.steadyrl.v1 import weightsync_pb2_grpc

ENV = "STEADYRL_JOB_RENDEZVOUS"  # the agent tells its ranks where their round is: {"endpoint", "job", "round"}
CALL_SECONDS = 30.0  # one put or add, weight-sync given that long to be reachable
WAIT_SECONDS = 10.0  # one wait at the service (which bounds it by its own timeout too)
_KEPT: list[
    JobStore
] = []  # torch reaches a Python store's methods through its Python object: it lives as long as the process


class RendezvousRefused(RuntimeError):
    """Weight-sync refused a key: `code` PERMISSION_DENIED for a round not open or a bound passed,
    UNAUTHENTICATED for no or a wrong token, INVALID_ARGUMENT for a malformed request."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


class RendezvousClient:
    """A job's key spaces at weight-sync: one channel, with the deployment's token and TLS."""

    def __init__(self, endpoint: str, job: str) -> None:
        from shared.rpc import channel_options
        from shared.rpc.auth import token_from_env
        from shared.rpc.tls import sync_channel, tls_from_env

        self.endpoint = endpoint
        self.job = job
        self.channel = sync_channel(endpoint, options=channel_options(), tls=tls_from_env())
        self.stub = weightsync_pb2_grpc.WeightSyncStub(self.channel)
        token = token_from_env()
        self.metadata = [("authorization", f"Bearer {token}")] if token else None

    def _call(self, method, key: pb.RendezvousKey, seconds: float):
        try:
            return method(key, metadata=self.metadata, timeout=seconds, wait_for_ready=True)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                raise TimeoutError(f"rendezvous key {key.key!r}: {exc.details()}") from None
            message = f"weight-sync refused rendezvous key {key.key!r} ({exc.code().name}): {exc.details()}"
            raise RendezvousRefused(message, exc.code()) from None

    def _key(self, number: int, key: str, value: bytes = b"", timeout: float = 0.0) -> pb.RendezvousKey:
        return pb.RendezvousKey(epoch=number, job=self.job, key=key, value=value, timeout_seconds=timeout)

    def put(self, number: int, key: str, value: bytes) -> None:
        self._call(self.stub.RendezvousPut, self._key(number, key, value), CALL_SECONDS)

    def add(self, number: int, key: str, amount: int) -> int:
        reply = self._call(self.stub.RendezvousAdd, self._key(number, key, str(amount).encode()), CALL_SECONDS)
        return int(reply.value)

    def get(self, number: int, key: str, seconds: float) -> bytes:
        """The key's value once set, waiting `seconds` at most (TimeoutError), a bounded wait at a time."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            ask = max(min(left, WAIT_SECONDS), 0.0)
            try:
                return self._call(
                    self.stub.RendezvousWait, self._key(number, key, timeout=ask), ask + CALL_SECONDS
                ).value
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise

    def check(self, number: int, key: str) -> bool:
        try:
            self._call(self.stub.RendezvousWait, self._key(number, key), CALL_SECONDS)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.channel.close()


class JobStore(dist.Store):
    """One round of a job's rendezvous as a torch.distributed store (an agent's, or its ranks')."""

    def __init__(self, client: RendezvousClient, number: int, timeout: timedelta) -> None:
        super().__init__()
        self.client = client
        self.round = number
        self.seconds = timeout.total_seconds()

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.seconds)

    def set_timeout(self, timeout: timedelta) -> None:
        self.seconds = timeout.total_seconds()

    def set(self, key: str, value) -> None:
        self.client.put(self.round, key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        try:
            return self.client.get(self.round, key, self.seconds)
        except TimeoutError as exc:
            raise dist.DistStoreError(str(exc)) from None

    def add(self, key: str, amount: int) -> int:
        return self.client.add(self.round, key, amount)

    def check(self, keys: list[str]) -> bool:
        return all(self.client.check(self.round, key) for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self.seconds if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + seconds
        for key in keys:
            try:
                self.client.get(self.round, key, max(deadline - time.monotonic(), 0.0))
            except TimeoutError as exc:
                raise dist.DistStoreError(str(exc)) from None

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def multi_set(self, keys: list[str], values: list) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)


def rank_store(timeout_seconds: float) -> dict:
    """`init_process_group`'s store, rank and world size for a rank whose agent met the others
    through the job's rendezvous (it exports `ENV`); empty otherwise (torch's env:// then)."""
    where = os.environ.get(ENV)
    if not where:
        return {}
    place = json.loads(where)
    store = JobStore(
        RendezvousClient(place["endpoint"], place["job"]), int(place["round"]), timedelta(seconds=timeout_seconds)
    )
    _KEPT.append(store)
    return {"store": store, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
