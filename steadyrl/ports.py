"""Listening ports for the processes `steadyrl run` starts on loopback.

A port is drawn below the ephemeral range, where outgoing connections never land, and stays bound by the launcher
(not listening) until just before the process that will listen on it starts, so neither an outgoing connection nor
another launcher's draw can take it meanwhile.

Details: docs/internals/cli.md"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000
ATTEMPTS = 200


def listen_range(ephemeral: Path = EPHEMERAL) -> tuple[int, int]:
    """Ports to draw from: [LOWEST, start of the ephemeral range); where the range is not known (not
    Linux) or leaves no room, below 49152 (the IANA dynamic range, macOS's ephemeral range)."""
    try:
        low = int(ephemeral.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 49152
    return (LOWEST, low - 1) if low - 1 > LOWEST + 1000 else (LOWEST, 49151)


class PortReservations:
    """Ports drawn for one run, each held bound until `release`d to the process that listens on it."""

    def __init__(self, host: str = "127.0.0.1", ephemeral: Path = EPHEMERAL) -> None:
        self.host = host
        self.range = listen_range(ephemeral)
        self.held: dict[int, socket.socket] = {}

    def take(self) -> int:
        for _ in range(ATTEMPTS):
            port = random.randint(*self.range)
            if port in self.held:
                continue
            sock = socket.socket()
            try:
                sock.bind((self.host, port))
            except OSError:
                sock.close()
                continue
            self.held[port] = sock
            return port
        raise RuntimeError(f"no free port in {self.range[0]}-{self.range[1]} on {self.host} after {ATTEMPTS} draws")

    def release(self, *ports: int) -> None:
        """Unbind `ports` (the process that listens on them starts next); unknown ones are ignored."""
        for port in ports:
            sock = self.held.pop(port, None)
            if sock is not None:
                sock.close()

    def close(self) -> None:
        self.release(*list(self.held))
