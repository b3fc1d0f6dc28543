"""torchrun's rendezvous backend `steadyrl`: the trainer's nodes meet at the weight-sync service,
behind its token, not in torch's c10d store (a TCPStore anyone who reaches its port may write,
whose state torch's DynamicRendezvousHandler unpickles).

A job (`--rdzv-id`) meets in rounds of exactly `--nnodes` nodes: the first to add themselves to a
round are its members (node rank: arrival order, or `--rdzv-conf node_rank=K`), a later node tries
the next round. A node whose ranks fail joins the next round and the others, seeing it wait
there, join too (torchrun restarts their ranks); a node started afresh begins at the newest round.
A round's key space is its agents' store and their ranks' (`job_store.py`); nothing is unpickled.

Details: docs/guides/multi-node.md"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import timedelta

import grpc
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from shared.runtime.job_store import ENV, JobStore, RendezvousClient, RendezvousRefused

log = logging.getLogger("steadyrl.rendezvous")
BACKEND = "steadyrl"
COUNTERS = 0  # the job's round 0: how many rounds were opened ("rounds")
POLL_SECONDS = 1.0  # how often a running node asks whether another waits in the next round


class JobRendezvousHandler(RendezvousHandler):
    def __init__(
        self, client: RendezvousClient, nodes: int, node_rank: int | None, timeout: float, host: str = ""
    ) -> None:
        if node_rank is not None and not 0 <= node_rank < nodes:
            raise ValueError(f"node_rank {node_rank} is not one of the job's {nodes} nodes")
        self.client = client
        self.nodes = nodes
        self.node_rank = node_rank
        self.timeout = timeout
        self.host = host or socket.getfqdn()
        self.round = 0  # the round this node last met in (0: none yet)
        self._waiting = (0.0, 0)  # (when asked, how many were waiting)

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.client.job

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and wait until it holds every node (RendezvousTimeoutError past
        the join timeout; RendezvousClosedError when a round of this node's was closed)."""
        if self.round and self.is_closed():
            raise RendezvousClosedError(f"the rendezvous of job {self.client.job!r} is closed")
        deadline = time.monotonic() + self.timeout
        number, slot = self._join(max(self.round + 1, self.client.add(COUNTERS, "rounds", 0)))
        rank = slot - 1 if self.node_rank is None else self.node_rank
        if self.client.add(number, f"rank/{rank}", 1) != 1:
            raise RendezvousStateError(f"two nodes of job {self.client.job!r} claim node rank {rank}")
        self.client.put(number, f"node/{rank}", json.dumps({"host": self.host, "pid": os.getpid()}).encode())
        if slot == self.nodes:
            self.client.put(number, "complete", b"1")
        try:
            self.client.get(number, "complete", max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            self.client.put(number, "closed", b"1")  # nodes that come later go on to the next round
            raise RendezvousTimeoutError(
                f"round {number} of job {self.client.job!r} did not gather {self.nodes} nodes in {self.timeout:.0f} s"
            ) from None
        self.round = number
        self._waiting = (0.0, 0)
        os.environ[ENV] = json.dumps({"endpoint": self.client.endpoint, "job": self.client.job, "round": number})
        log.info(
            "event=rendezvous_complete job=%s round=%d node_rank=%d nodes=%d", self.client.job, number, rank, self.nodes
        )
        host, _, port = self.client.endpoint.rpartition(":")
        store = JobStore(self.client, number, timedelta(seconds=self.timeout))
        return RendezvousInfo(store, rank, self.nodes, RendezvousStoreInfo(host, int(port)))

    def _join(self, number: int) -> tuple[int, int]:
        """(round, arrival slot) of the first round from `number` on with room, not closed."""
        while True:
            try:
                slot = self.client.add(number, "joined", 1)
            except RendezvousRefused as exc:  # the service lost its rounds (restarted), or the job moved past
                newest = max(self.client.add(COUNTERS, "rounds", 0), 1)
                if exc.code != grpc.StatusCode.PERMISSION_DENIED or newest == number:
                    raise RendezvousStateError(str(exc)) from None
                number = newest
                continue
            if slot == 1:
                self.client.add(COUNTERS, "rounds", 1)
            if slot <= self.nodes and not self.client.check(number, "closed"):
                return number, slot
            number += 1

    def is_closed(self) -> bool:
        try:
            return bool(self.round) and self.client.check(self.round, "closed")
        except RendezvousRefused:  # a round the service no longer holds is not closed
            return False

    def set_closed(self) -> None:
        if self.round:
            self.client.put(self.round, "closed", b"1")

    def num_nodes_waiting(self) -> int:
        """Nodes in the round after this node's (asked once a second at most; 0 while weight-sync
        cannot say: a running job does not stop for it)."""
        asked, waiting = self._waiting
        if not self.round or time.monotonic() - asked < POLL_SECONDS:
            return waiting
        try:
            waiting = self.client.add(self.round + 1, "joined", 0)
        except RendezvousRefused:
            waiting = 0
        except TimeoutError:
            log.warning("event=rendezvous_unreachable job=%s endpoint=%s", self.client.job, self.client.endpoint)
            waiting = 0
        self._waiting = (time.monotonic(), waiting)
        return waiting

    def shutdown(self) -> bool:
        try:
            self.set_closed()
        except (RendezvousRefused, TimeoutError):
            return False
        finally:
            self.client.close()
        return True


def create_handler(params: RendezvousParameters) -> JobRendezvousHandler:
    """The handler torchrun makes for `--rdzv-backend steadyrl --rdzv-endpoint WEIGHTSYNC_HOST:PORT`
    (`--rdzv-conf join_timeout=SECONDS,node_rank=K`)."""
    if params.min_nodes != params.max_nodes:
        raise ValueError(f"the {BACKEND} rendezvous meets a fixed number of nodes: --nnodes N, not a range")
    host, _, port = params.endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--rdzv-endpoint is weight-sync's host:port, not {params.endpoint!r}")
    return JobRendezvousHandler(
        RendezvousClient(params.endpoint, params.run_id),
        params.max_nodes,
        params.get_as_int("node_rank"),
        float(params.get_as_int("join_timeout", 600)),
        params.local_addr or "",
    )


def register() -> None:
    """Make `--rdzv-backend steadyrl` known to torchrun's handler registry (this process's)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)
