"""The weight transports off the gRPC path, timed against a raw loopback socket in the same run:
a gloo broadcast of a version to 1 and 2 receiving processes (and raw sockets to as many at
once), and a shared-memory version mapped, verified and loaded by a replica process. Every
receiver writes into resident memory (a running replica's weights and staging buffers are),
so page faults are not what is measured.
Used by bench.weightsync (`steadyrl bench weightsync`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MEMBER = r"""
import datetime, json, sys, time, torch, torch.distributed as dist
from shared.weight_transport import Staging, receive_version, send_version
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
rank, world, port, manifest_path, verify = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
torch.set_num_threads(1)
manifest = pb.WeightManifest.FromString(open(manifest_path, "rb").read())
transport = pb.Transport(kind=pb.COLLECTIVE, epoch=1, world_size=world, store_address=f"127.0.0.1:{port}",
                         bucket_bytes=256 << 20, backend="gloo", timeout_seconds=120)
store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
group = dist.ProcessGroupGloo(dist.PrefixStore("steadyrl/weights/1/", store), rank, world, datetime.timedelta(seconds=120))
if rank == 0:
    gen = torch.Generator().manual_seed(0)
    tensors = {s.name: torch.randn(list(s.shape), generator=gen).to(getattr(torch, s.dtype)) for s in manifest.tensors}
staging = Staging()  # resident buffers, as a running replica and trainer hold them
for timed in (False, True):  # the first version allocates them; the second is the steady state
    group.barrier().wait()
    started = time.perf_counter()
    if rank == 0:
        send_version(group, transport, manifest, tensors, staging)
    else:
        receive_version(group, transport, manifest, verify=verify, staging=staging)
    group.barrier().wait()
print(json.dumps({"rank": rank, "seconds": time.perf_counter() - started}), flush=True)
"""

REPLICA = r"""
import json, sys, time, torch
from shared.weight_transport import read_shm
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
manifest = pb.WeightManifest.FromString(open(sys.argv[2], "rb").read())
torch.set_num_threads(1)
params = {s.name: torch.zeros(list(s.shape), dtype=getattr(torch, s.dtype)) for s in manifest.tensors}
for p in params.values():
    p.fill_(1)  # a serving engine's weights are resident
started = time.perf_counter()
tensors = read_shm(sys.argv[1], manifest, verify=sys.argv[3] == "1")  # map (+ verify every digest)
for name, tensor in tensors.items():                    # load: into the engine's tensors
    params[name].copy_(tensor)
print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)
"""


def _free_port() -> int:
    from shared.redis_server import free_port

    return free_port()


def collective_seconds(state: dict[str, torch.Tensor], receivers: int, verify: bool) -> float:
    """Seconds until every receiver holds the version (broadcast from a separate root process)."""
    from shared.weights import describe

    manifest = describe(state, 1, 0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "manifest.pb"
        path.write_bytes(manifest.SerializeToString())
        port = _free_port()
        root = Path(__file__).resolve().parents[1]
        procs = [subprocess.Popen([sys.executable, "-c", MEMBER, str(r), str(receivers + 1), str(port), str(path),
                                   "1" if verify else "0"], stdout=subprocess.PIPE, text=True, cwd=root,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(receivers + 1)]
        results = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    return max(r["seconds"] for r in results if r["rank"] > 0)


def raw_sockets_seconds(nbytes: int, receivers: int) -> float:
    """Seconds for `receivers` processes to each receive `nbytes` over loopback TCP, at once."""
    from bench.weightsync import RAW_SENDER

    receiver = r"""
import socket, sys
size, port = int(sys.argv[1]), int(sys.argv[2])
buffer = bytearray(size)
for i in range(0, size, 4096):
    buffer[i] = 1  # resident, like a replica's weights or staging buffers
view = memoryview(buffer)
listener = socket.socket(); listener.bind(("127.0.0.1", port)); listener.listen(1)
print("ready", flush=True)
conn, _ = listener.accept(); got = 0
while got < size:
    n = conn.recv_into(view[got:], min(size - got, 1 << 22)); got += n
"""
    ports = [_free_port() for _ in range(receivers)]
    recvs = [subprocess.Popen([sys.executable, "-c", receiver, str(nbytes), str(p)], stdout=subprocess.PIPE, text=True)
             for p in ports]
    for r in recvs:
        r.stdout.readline()
    started = time.perf_counter()
    senders = [subprocess.Popen([sys.executable, "-c", RAW_SENDER, str(nbytes), str(p)]) for p in ports]
    for r in recvs:
        r.wait()
    seconds = time.perf_counter() - started
    for s in senders:
        s.wait()
    return seconds


def shm_seconds(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The trainer writes the version to shared memory (digesting it); a replica process maps it
    and copies it into its own tensors, once without and once with verifying every digest (a raw
    socket verifies nothing: the first is the like-for-like figure, the second what runs)."""
    from shared.weight_transport import write_shm

    directory = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / "v1.safetensors"
        started = time.perf_counter()
        manifest = write_shm(path, state, 1, 0)
        write = time.perf_counter() - started
        manifest_path = Path(tmp) / "manifest.pb"
        manifest_path.write_bytes(manifest.SerializeToString())
        root = Path(__file__).resolve().parents[1]
        out = {"write_seconds": write}
        for name, verify in (("map_load_seconds", "0"), ("map_verify_load_seconds", "1")):
            done = subprocess.run([sys.executable, "-c", REPLICA, str(path), str(manifest_path), verify],
                                  capture_output=True, text=True, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  timeout=600)
            out[name] = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    return out
