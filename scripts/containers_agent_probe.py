"""Run inside an inference replica's container by scripts/containers_check.py --agents (fed to
`python -` on stdin): an agent program started as this replica starts one (its own settings'
`agent_isolation_of()`, `agent_programs.run`), which reports what it can see: each file under
/run/secrets (the replica reads them all), the entries of /run/secrets, the processes it sees, and
whether it can make a user namespace. Its code and the secrets' paths reach it in its environment,
not its command (whose files an agent program is given). Prints one JSON object; exit 1 when agent programs
cannot run isolated here, or the agent read a secret, or (where the isolation disables them) made a
user namespace."""

import asyncio
import inspect
import json
import os
import sys
from pathlib import Path

AGENT = r"""
import ctypes, json, os
seen = {}
for path in json.loads(os.environ["PROBE_SECRETS"]):
    try:
        with open(path, "rb") as f:
            f.read()
        seen[path] = "read"
    except OSError as exc:
        seen[path] = type(exc).__name__
try:
    entries = sorted(os.listdir("/run/secrets"))
except OSError as exc:
    entries = type(exc).__name__
pid = os.fork()
if pid == 0:  # a user namespace of its own, tried in a child
    os._exit(0 if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0 else 1)
made = os.waitpid(pid, 0)[1] == 0
processes = sum(1 for name in os.listdir("/proc") if name.isdigit())
print(json.dumps({"secrets": seen, "secret_dir": entries, "processes": processes, "user_namespace": made}))
"""


def main() -> int:
    from services.inference import agent_programs
    from shared.envs import isolation
    from steadyrl.service_settings import deployed_settings

    how = deployed_settings("inference", os.environ).agent_isolation_of()
    secrets = sorted(str(p) for p in Path("/run/secrets").rglob("*") if p.is_file())
    result: dict = {"uid": os.getuid(), "refused": how.refused(), "replica_reads": {}}
    for path in secrets:
        try:
            Path(path).read_bytes()
            result["replica_reads"][path] = "read"
        except OSError as exc:
            result["replica_reads"][path] = type(exc).__name__
    if result["refused"] is not None:
        print(json.dumps(result))
        return 1
    result["disable_userns"] = "--disable-userns" in inspect.getsource(isolation)
    given = {"STEADYRL_PROMPT": "probe", "PROBE_SECRETS": json.dumps(secrets), "PROBE_CODE": AGENT}
    command = [sys.executable, "-I", "-c", 'import os; exec(os.environ["PROBE_CODE"])']
    status, out, err = asyncio.run(agent_programs.run(command, given, how, 120))
    result["agent_exit"] = status
    try:
        result["agent"] = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        result["agent"] = None
        result["agent_stderr"] = err[-2000:]
    agent = result["agent"] or {}
    failures = [f"the agent read {p}" for p, how_ in agent.get("secrets", {}).items() if how_ == "read"]
    failures += [f"the replica cannot read {p}: {r}" for p, r in result["replica_reads"].items() if r != "read"]
    if not secrets:
        failures.append("no file under /run/secrets: nothing to hide")
    if status != 0 or not agent:
        failures.append(f"the agent program failed: exit {status}")
    if result["disable_userns"] and agent.get("user_namespace"):
        failures.append("the agent made a user namespace though bubblewrap was asked to disable them")
    result["failures"] = failures
    print(json.dumps(result))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
