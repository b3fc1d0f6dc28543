"""The processes of the weight benchmark, each one side of a transfer (`python -m bench.roles ROLE
ARGS...`, driven by bench/clock.py: set up, `ready`, wait for `go`, do the part, `end`).

Every receiver ends with the version in tensors it holds resident — what an engine serves from —
checked against the manifest where the transport checks it: the raw socket and memcpy write into
their resident buffer directly; gRPC, shm and the collective verify, then copy into it. Every
sender starts from the version resident in the dtype it publishes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import torch

TENSOR_BYTES = 64 << 20


def ready(**extra: object) -> None:
    """Say ready, then wait for `go` (the clock starts in the parent, bench/clock.py, before it is sent)."""
    print(json.dumps({"event": "ready", **extra}), flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go: the benchmark was stopped")


def end(**extra: object) -> None:
    """The moment this process's part is done, on the clock every process of a host shares."""
    print(json.dumps({"event": "end", "at": time.monotonic(), **extra}), flush=True)


def shapes(nbytes: int) -> dict[str, int]:
    """The synthetic version: name → bf16 elements, 64 MiB per tensor."""
    count = max(1, nbytes // TENSOR_BYTES)
    return {f"layers.{i}.weight": TENSOR_BYTES // 2 for i in range(count)}


def synthetic_state(nbytes: int) -> dict[str, torch.Tensor]:
    """The same bf16 bytes in every process that builds it (seeded per tensor)."""
    out = {}
    for i, (name, numel) in enumerate(shapes(nbytes).items()):
        generator = torch.Generator().manual_seed(i)
        out[name] = torch.randint(-(1 << 15), 1 << 15, (numel,), dtype=torch.int16, generator=generator).view(
            torch.bfloat16)
    return out


def resident(nbytes: int) -> dict[str, torch.Tensor]:
    """An engine's weights: allocated and written once, so no page fault is timed."""
    return {name: torch.ones(numel, dtype=torch.bfloat16) for name, numel in shapes(nbytes).items()}


def load(params: dict[str, torch.Tensor], tensors) -> None:
    for name, tensor in tensors.items():
        params[name].copy_(tensor.reshape(-1))


# Every role moves one version untimed first, then the timed one: the trainer, the replicas and
# weight-sync are long-running processes, and a process's first transfer pays its allocator's and
# libraries' first use (a first gRPC pull here takes 2.4× the next). The resident buffers an engine
# holds are written before either.

# --- the machine's limits ------------------------------------------------------------------------

def memcpy(nbytes: str) -> None:
    source, target = synthetic_state(int(nbytes)), resident(int(nbytes))
    load(target, source)
    ready()
    load(target, source)
    end()


def raw_recv(port: str, nbytes: str) -> None:
    buffer = bytearray(int(nbytes))
    for i in range(0, len(buffer), 4096):
        buffer[i] = 1  # resident
    view = memoryview(buffer)
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(port)))
        listener.listen(1)
        print('{"event": "listening"}', flush=True)
        conn, _ = listener.accept()
    with conn:
        for timed in (False, True):
            if timed:
                ready()
            got = 0
            while got < len(buffer):
                n = conn.recv_into(view[got:], min(len(buffer) - got, 1 << 22))
                if n == 0:
                    raise SystemExit("the sender closed early")
                got += n
        end()


def raw_send(port: str, nbytes: str) -> None:
    payload = bytearray(b"\x5a") * int(nbytes)  # resident, like a trainer's published tensors
    with socket.create_connection(("127.0.0.1", int(port))) as conn:
        conn.sendall(payload)
        ready()
        conn.sendall(payload)
        end()


# --- gRPC (the weight-sync service in its own process) -------------------------------------------

def grpc_push(address: str, nbytes: str, version: str) -> None:
    """Pushes `version` untimed, then `version` + 1."""
    from shared.weightsync.grpc import GrpcWeightPublisher

    state = synthetic_state(int(nbytes))

    async def main() -> None:
        publisher = GrpcWeightPublisher(address)
        await publisher.push(state, int(version), int(version) - 1, timeout=600)
        ready()
        await publisher.push(state, int(version) + 1, int(version), timeout=600)
        end()
        await publisher.close()

    asyncio.run(main())


def grpc_pull(address: str, nbytes: str) -> None:
    from shared.weightsync.grpc import pull_all, to_state_dict

    params = resident(int(nbytes))
    for timed in (False, True):
        if timed:
            ready()
        manifest, payloads, _ = pull_all(address, 1)  # every tensor's digest checked
        load(params, to_state_dict(manifest, payloads))
        del manifest, payloads
    end()


# --- shared memory: the trainer writes (and digests), then a replica maps, verifies, loads ------

def shm_write(directory: str, nbytes: str) -> None:
    """Writes version 0 untimed (`warmed`: the reader warms up on it), then version 1."""
    from shared.weightsync.shm import write_shm

    state = synthetic_state(int(nbytes))
    for version in (0, 1):
        if version:
            ready()
        manifest = write_shm(Path(directory) / f"v{version}.safetensors", state, version, 0)
        (Path(directory) / f"manifest-{version}.pb").write_bytes(manifest.SerializeToString())
        if not version:
            print('{"event": "warmed"}', flush=True)
    end()


def shm_load(directory: str, nbytes: str) -> None:
    from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
    from shared.weightsync.shm import read_shm

    params = resident(int(nbytes))
    for version in (0, 1):
        if version:
            ready()
        manifest = pb.WeightManifest.FromString((Path(directory) / f"manifest-{version}.pb").read_bytes())
        load(params, read_shm(Path(directory) / f"v{version}.safetensors", manifest, verify=True))
    end()


# --- the collective: a gloo group formed, one version sent untimed (buffers allocated) ----------

def collective(rank: str, world: str, port: str, manifest_path: str, nbytes: str) -> None:
    import datetime

    import torch.distributed as dist

    from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
    from shared.weightsync.collective import Staging, receive_buckets, send_version

    rank, world = int(rank), int(world)
    manifest = pb.WeightManifest.FromString(Path(manifest_path).read_bytes())
    transport = pb.Transport(kind=pb.COLLECTIVE, epoch=1, world_size=world, store_address=f"127.0.0.1:{port}",
                             bucket_bytes=256 << 20, backend="gloo", timeout_seconds=120)
    store = dist.TCPStore("127.0.0.1", int(port), None, rank == 0, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    group = dist.ProcessGroupGloo(dist.PrefixStore("steadyrl/weights/1/", store), rank, world,
                                  datetime.timedelta(seconds=120))
    state = synthetic_state(int(nbytes)) if rank == 0 else resident(int(nbytes))
    staging = Staging()
    for timed in (False, True):  # the first version allocates the buffers; the second is the steady state
        group.barrier().wait()
        if timed:
            ready()
        if rank == 0:
            send_version(group, transport, manifest, state, staging)
        else:
            for bucket in receive_buckets(group, transport, manifest, staging):  # each bucket checked
                load(state, dict(bucket))
    end()


ROLES = {f.__name__: f for f in (memcpy, raw_recv, raw_send, grpc_push, grpc_pull, shm_write, shm_load, collective)}

if __name__ == "__main__":
    torch.set_num_threads(1)
    ROLES[sys.argv[1]](*sys.argv[2:])
