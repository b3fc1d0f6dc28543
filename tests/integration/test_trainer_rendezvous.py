"""The multi-node trainer's rendezvous (torchrun's `steadyrl` backend, `shared/runtime/job_rendezvous.py`):
two real torchrun launchers on loopback meet at a real weight-sync behind its token, and their
ranks form a gloo process group in the round's key space there. Every port that the launchers
and their ranks open, and weight-sync's own, is then probed without the token — as a TCPStore
client writing pickles where torch's c10d rendezvous keeps its state, as raw pickle bytes, as a
gRPC caller — and nothing is taken: no node executes anything, and the job still finishes. What
the rounds' key spaces hold is listed: JSON, decimal counters and gloo's addresses, no pickle.
The control: the same probe against torchrun's c10d rendezvous makes a launcher run its pickle."""

import asyncio
import base64
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import grpc
import psutil
import pytest
import torch.distributed as dist

from services.trainer.config import TrainerSettings
from shared.rpc.auth import channel
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.rpc.steadyrl.v1 import weightsync_pb2_grpc
from shared.runstore.redis_server import free_port
from steadyrl.placement import node_argv
from tests.integration.test_weightsync import Server

pytestmark = pytest.mark.process
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "trainer-rendezvous-token"
JOB = "job-under-probe"
RANK = """
import json, os, sys, time
import torch, torch.distributed as dist
from shared.runtime.distributed import init_from_env
out = sys.argv[1]
rank, world = init_from_env(None, 60)
first = torch.full((4,), float(rank + 1)); dist.all_reduce(first)
open(f"{out}/ready-{rank}", "w").write(str(os.getpid()))
deadline = time.monotonic() + 120
while not os.path.exists(f"{out}/go") and time.monotonic() < deadline:
    time.sleep(0.05)
second = torch.full((4,), float(10 * (rank + 1))); dist.all_reduce(second)
open(f"{out}/done-{rank}", "w").write(json.dumps([world, first.tolist(), second.tolist()]))
dist.barrier()
dist.destroy_process_group()
"""


class Planted:
    """Unpickled anywhere, it creates its file: the proof that a node executed what a stranger sent."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def listening(pid: int) -> list[int]:
    return sorted({c.laddr.port for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"})


def probe_tcpstore(port: int, payloads: dict[str, bytes]) -> str:
    """Write `payloads` as a TCPStore client (torch's c10d rendezvous keeps its pickled state so)."""
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
        for key, value in payloads.items():
            store.set(key, value)
    except (RuntimeError, dist.DistError) as exc:
        return type(exc).__name__
    return "written"


async def bounded(probe, *args, seconds: float = 5.0) -> str:
    """`probe(*args)` in a thread of its own, "no answer" past `seconds` (a TCPStore client waits
    on a gloo listener until the rank closes it; the thread ends with the ranks, within the test)."""
    result = ["no answer"]
    thread = threading.Thread(target=lambda: result.__setitem__(0, probe(*args)), daemon=True)
    thread.start()
    await asyncio.to_thread(thread.join, seconds)
    return result[0]


def probe_raw(port: int, data: bytes) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as conn:
            conn.sendall(data)
            conn.settimeout(1)
            try:
                return "answered" if conn.recv(1) else "closed"
            except TimeoutError:
                return "silent"
    except OSError as exc:
        return type(exc).__name__


async def probe_grpc(port: int, value: bytes) -> str:
    async with channel(f"127.0.0.1:{port}", token="") as ch:  # no token
        stub = weightsync_pb2_grpc.WeightSyncStub(ch)
        try:
            await stub.RendezvousPut(
                pb.RendezvousKey(epoch=1, job=JOB, key="torchelastic/assigned_ranks/0", value=value), timeout=2
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return "OK"


async def launch_and_probe(tmp_path: Path, argv: list[str], env: dict, ports: set[int]) -> dict:
    """Two nodes of `argv`; once their ranks formed their group, every port the launchers, their
    ranks and `ports` listen on is probed with a pickle that creates tmp_path/executed when loaded;
    then the ranks finish. Returns what was seen."""
    evil = pickle.dumps(Planted(tmp_path / "executed"))
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in "ab"}  # noqa: SIM115 - closed below
    nodes = {n: subprocess.Popen(argv, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT) for n, f in logs.items()}
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in nodes.values())
            await asyncio.sleep(0.1)
        agents = {n: listening(p.pid) for n, p in nodes.items()}
        ranks = [c.pid for p in nodes.values() for c in psutil.Process(p.pid).children(recursive=True)]
        ports = {port for pid in ranks for port in listening(pid)} | {p for a in agents.values() for p in a} | ports
        payloads = {
            f"torch.rendezvous.{JOB}": base64.b64encode(evil),  # where c10d's DynamicRendezvousHandler reads its state
            "torchelastic/role_info/0": evil,
            "MASTER_ADDR": evil,
        }
        probes = {}
        for port in sorted(ports):
            probes[port] = (
                await bounded(probe_tcpstore, port, payloads),
                await asyncio.to_thread(probe_raw, port, evil),
                await probe_grpc(port, evil),
            )
        await asyncio.sleep(1.0)  # a launcher reads its rendezvous's state at least every 0.1 s
        executed = (tmp_path / "executed").exists()
        (tmp_path / "go").write_text("")
        codes = {n: await asyncio.to_thread(p.wait, 120) for n, p in nodes.items()}
    finally:
        for process in nodes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        for f in logs.values():
            f.close()
    return {"agents": agents, "ranks": ranks, "probes": probes, "executed": executed, "codes": codes}


def rank_script(tmp_path: Path) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return [str(script), str(tmp_path)]


def test_the_probe_runs_code_through_torchs_c10d_rendezvous(tmp_path):
    """The control: torchrun's own c10d rendezvous, as `steadyrl trainer-node` ran it before, takes the
    probe's pickle from its store port and a launcher executes it (so the probe can find what it seeks)."""
    port = free_port()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", JOB, *rank_script(tmp_path)]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    seen = asyncio.run(asyncio.wait_for(launch_and_probe(tmp_path, argv, env, set()), 300))
    assert port in [p for ports in seen["agents"].values() for p in ports]  # the store port of node a's launcher
    assert seen["probes"][port][0] == "written" and seen["executed"]  # a stranger's pickle, run by a node


def test_no_port_of_the_trainer_rendezvous_takes_a_strangers_pickle(tmp_path, monkeypatch):
    monkeypatch.setenv("STEADYRL_TOKEN", TOKEN)
    server = Server(tmp_path)
    parallel = TrainerSettings(
        model_path="m", parallel={"nodes": 2, "ranks": 1, "rdzv_endpoint": server.address, "rdzv_timeout_seconds": 60}
    ).parallel
    argv = [sys.executable, *node_argv(parallel, JOB, entry=rank_script(tmp_path))]
    env = {**os.environ, "STEADYRL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    async def main():
        await server.start()
        try:
            seen = await launch_and_probe(tmp_path, argv, env, {server.port})
        finally:
            await server.stop()
        return seen, server.servicer.transfers.rendezvous.held(JOB)

    seen, held = asyncio.run(asyncio.wait_for(main(), 300))
    logs = "".join((tmp_path / f"{n}.log").read_text() for n in "ab")
    assert seen["codes"] == {"a": 0, "b": 0}, logs[-4000:]
    assert seen["agents"] == {"a": [], "b": []}  # the launchers listen on nothing
    probes = seen["probes"]
    assert len(seen["ranks"]) == 2 and len(probes) >= 3  # weight-sync's port and each rank's gloo listener at least
    for port, (store, _raw, rpc) in probes.items():
        assert store != "written", (port, probes)  # no TCPStore anywhere
        assert rpc != "OK", (port, probes)  # no key taken without the token
    assert probes[server.port][2] == "UNAUTHENTICATED"
    assert not seen["executed"] and not (tmp_path / "executed").exists()  # nothing a stranger sent was run
    done = [json.loads((tmp_path / f"done-{r}").read_text()) for r in (0, 1)]
    assert done == [[2, [3.0] * 4, [30.0] * 4]] * 2  # the group was not disturbed
    # what the job's rounds hold: the nodes' JSON, decimal counters, gloo's addresses — no pickle
    families = {re.sub(r"\d+", "N", key) for space in held.values() for key in space}
    assert families == {
        "rounds",  # round 0: how many rounds were opened
        "joined",  # each round: its arrivals, its members' node ranks and hosts, complete, closed at the end
        "rank/N",
        "node/N",
        "complete",
        "closed",
        "torchelastic/role_info/N",  # the agents' rank assignment (JSON) and exit barrier (counters)
        "torchelastic/assigned_ranks/N",
        "torchelastic/agent/terminal_state/num_members",
        "torchelastic/agent/terminal_state/last_member",
        "N//cpu//N/N",  # the ranks' process group: each rank's gloo address
    }, families
    values = [value for space in held.values() for value in space.values()]
    assert values and not [v for v in values if v.startswith(b"\x80")]  # no pickle protocol header
