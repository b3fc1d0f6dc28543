"""The first process in an agent program's sandbox (standard library only;
`python -I -S agent_forwarder.py CONFIG_JSON COMMAND...`, as bubblewrap's command):

- sets the program's per-process limits (`rlimits`: those no cgroup holds, and no core dumps);
- listens on 127.0.0.1:`port` in the program's own network namespace and relays every connection to the
  replica's endpoint through `socket`, the endpoint's unix socket bound into the sandbox: the program dials an
  ordinary `OPENAI_BASE_URL=http://127.0.0.1:PORT/...`, and no other address of the host exists for it;
- runs COMMAND and exits with its status (128 + the signal that ended it).

The program may end this process too: bubblewrap then ends everything in the sandbox, the program included.
"""

import contextlib
import json
import resource
import socket
import subprocess
import sys
import threading
import time


def relay(source: socket.socket, sink: socket.socket) -> None:
    """Copy `source` to `sink` until `source` ends, then end `sink`'s writing half."""
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def connection(client: socket.socket, path: str) -> None:
    with client, socket.socket(socket.AF_UNIX) as upstream:
        try:
            upstream.connect(path)
        except OSError:
            return  # the replica is gone: the program's call fails as a refused connection would
        back = threading.Thread(target=relay, args=(upstream, client), daemon=True)
        back.start()
        relay(client, upstream)
        back.join()


def serve(listener: socket.socket, path: str) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:  # a connection reset before it was accepted, or no file descriptor left: a pause
            time.sleep(0.05)
            continue
        try:
            threading.Thread(target=connection, args=(client, path), daemon=True).start()
        except RuntimeError:  # no thread left under the program's process limit: this connection is refused
            client.close()


def main(config: dict, command: list[str]) -> int:
    for name, value in config["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if config.get("socket"):
        listener = socket.create_server(("127.0.0.1", int(config["port"])))
        threading.Thread(target=serve, args=(listener, config["socket"]), daemon=True).start()
    try:
        program = subprocess.Popen(command)
    except OSError as exc:
        print(f"the agent {command[0]!r} could not start: {exc}", file=sys.stderr)
        return 127
    status = program.wait()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1]), sys.argv[2:]))
