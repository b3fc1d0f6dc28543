"""The processes of the weight benchmark (`python -m bench.roles ROLE ARGS...`, driven by
bench/clock.py: set up, `ready`, wait for `go`, do the part, `end`): the machine's limits here —
memcpy into resident memory, a raw loopback socket, one BLAKE3 pass, and the shm transport's own
work with nothing around it — and the trainer and replicas of the end-to-end refit in
bench/refit_roles.py.
"""

from __future__ import annotations

import socket
import sys

import torch

from bench.protocol import end, ready

TENSOR_BYTES = 64 << 20


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
            torch.bfloat16
        )
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
    source = synthetic_state(int(nbytes))
    target = resident(int(nbytes))
    load(target, source)
    ready()
    load(target, source)
    end()


def blake3_pass(nbytes: str) -> None:
    """One BLAKE3 pass over the bytes on one thread, as the shm writer hashes what it writes."""
    import blake3

    views = [memoryview(t.view(torch.uint8).numpy()) for t in synthetic_state(int(nbytes)).values()]

    def hash_all() -> None:
        for view in views:
            blake3.blake3(view).digest()

    hash_all()
    ready()
    hash_all()
    end()


def shm_floor(nbytes: str, directory: str) -> None:
    """The shm transport's own work and nothing else — no service, no announcement, no engine:
    the trainer's fp32 weights cast, written and hashed into a version file written over an older
    one (`write_shm`, the steady state), then that file mapped, every tensor checked against its
    digest and copied into resident bf16 weights, all in one process on one thread."""
    from pathlib import Path

    from shared.weightsync.manifest import CastView
    from shared.weightsync.shm import read_shm, write_shm

    master = {name: tensor.float() for name, tensor in synthetic_state(int(nbytes)).items()}
    target = resident(int(nbytes))
    folder = Path(directory)

    def refit(version: int) -> None:
        path = folder / f"v{version}.safetensors"
        manifest = write_shm(
            path, CastView(master, torch.bfloat16), version, version - 1, reuse=folder / f"v{version - 2}.safetensors"
        )
        load(target, read_shm(path, manifest))

    refit(1)
    refit(2)
    refit(3)  # over v1's file: its pages are in memory, as in the trainer's ring
    ready()
    refit(4)
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


def roles() -> dict:
    from bench.patch_roles import patch_trainer
    from bench.refit_roles import replica, trainer

    return {
        f.__name__: f for f in (memcpy, blake3_pass, shm_floor, raw_recv, raw_send, trainer, replica, patch_trainer)
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    roles()[sys.argv[1]](*sys.argv[2:])
