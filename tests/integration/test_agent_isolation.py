"""Agent programs are untrusted (docs/security.md). On a real replica an agent program finds none
of the run's secrets (its environment holds its endpoint, its session key, its prompt and what the
recipe names; the run's directory is not there), sees no other process but its sandbox's own, leaves
nothing running behind it, and cannot call another trajectory's session. Run one by one
(`agent_programs.run`, real bubblewrap, a real cgroup where one can be made), a program sees only the
system's files and its own, reaches only its endpoint, makes no namespace and none of the denied calls,
and is held to its memory, processes and CPU."""

import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from redis.asyncio import Redis

from services.inference import agent_programs
from services.inference.agent_programs import AgentIsolation
from shared.envs import cgroups, isolation
from shared.runstore.queues import WorkQueue
from tests.helpers import submit
from tests.integration.test_agents import agent_task
from tests.integration.test_inference import Replica, wait_for
from tests.integration.test_multiturn_replica import _dead
from tests.syscall_probe import NUMBERS

pytestmark = pytest.mark.skipif(isolation.unavailable() is not None, reason=f"{isolation.unavailable()}")
MARKER = "31337.5"  # `sleep 31337.5`: the process the probe leaves behind, found by its arguments
PROBE = Path(__file__).parents[1] / "syscall_probe.py"


def processes_with(marker: str) -> list[str]:
    done = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True)
    return [line for line in done.stdout.splitlines() if f"sleep {marker}" in line]


def test_an_agent_program_finds_no_secret_no_process_and_leaves_nothing_behind(
    tmp_path, calc_model_dir, redis_server, run_id, monkeypatch
):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    token = run_dir / "token"
    token.write_text("the-run-token")
    monkeypatch.setenv("STEADYRL_TEST_PASSED", "named-by-the-recipe")
    monkeypatch.setenv("STEADYRL_TEST_SECRET", "never-passed")
    monkeypatch.setenv("STEADYRL_TOKEN_FILE", str(token))
    probe = agent_task("probe", group_size=2)
    probe.environment = f"agent:{sys.executable} -m tests.agent_probe {token} {MARKER}"

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        async with Replica(
            tmp_path,
            calc_model_dir,
            redis_server.url,
            run_id,
            agent={"endpoint": True, "env": ["STEADYRL_TEST_PASSED"], "hidden_paths": [run_dir]},
            plugins=[probe.environment],
        ):
            await submit(queue, probe)
            await wait_for(lambda: _dead(queue, 1), 60)
            dead = {f[b"task_id"].decode(): f for _, f in await redis.xrange(queue.run_keys.dead)}
        await redis.aclose()
        return dead

    dead = asyncio.run(asyncio.wait_for(main(), 120))
    reason = dead["probe"][b"reason"].decode()
    report = dict(item.split("=", 1) for item in reason.split("REPORT ", 1)[1].split())
    assert report == {
        "token": "0",
        "token_dir": "0",  # the command names the token: its directory would be the program's own, and is hidden
        "processes": "2",  # bubblewrap's init and the program's forwarder
        "urls": "0",
        "passed": "named-by-the-recipe",
        "leaked": "-",
        "key": "1",
    }, reason
    assert processes_with(MARKER) == []


def test_a_session_answers_only_calls_that_carry_its_key(tmp_path, calc_model_dir, redis_server, run_id):
    """A process that learns a session's URL (a sibling agent) can neither read nor change it."""
    hold = agent_task("held", " --hang")

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        async with Replica(
            tmp_path, calc_model_dir, redis_server.url, run_id, agent={"endpoint": True}, plugins=[hold.environment]
        ) as replica:
            endpoint = replica.parts.endpoint
            await submit(queue, hold)
            await wait_for(lambda: _sessions(endpoint), 60)
            session_id, session = next(iter(endpoint.sessions.items()))
            url = f"{endpoint.base_url}/rollouts/{session_id}/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "12*34="}]}
            answers = [await asyncio.to_thread(post, url, body, key) for key in (None, "steadyrl", "x" * 43)]
            state = (session.trajectory, list(session.conversation), session.error)
            good = await asyncio.to_thread(post, url, body, session.key)
        await redis.aclose()
        return answers, state, good

    answers, state, good = asyncio.run(asyncio.wait_for(main(), 120))
    assert [a[0] for a in answers] == [401, 401, 401] and all(a[1]["error"]["type"] == "unauthorized" for a in answers)
    assert state == (None, [], None)
    assert good[0] == 200 and good[1]["object"] == "chat.completion"


async def _sessions(endpoint) -> bool:
    return bool(endpoint.sessions)


def post(url: str, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def play(tmp_path: Path, code: str, check: dict | None = None, seconds: float = 60, **how) -> tuple[int, str, str]:
    """Run `code` as an agent program (tmp_path/agent/prog.py, by this virtual environment's interpreter, as a
    recipe names one) isolated as a replica runs it: its endpoint a unix socket answering every request "pong",
    `check` in its environment as CHECK (JSON)."""
    program = tmp_path / "agent" / "prog.py"
    program.parent.mkdir(exist_ok=True)
    program.write_text(code)
    endpoint = tmp_path / "endpoint" / "endpoint.sock"
    endpoint.parent.mkdir(exist_ok=True)
    endpoint.unlink(missing_ok=True)

    async def answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 4\r\n\r\npong")
        await writer.drain()
        writer.close()

    async def main():
        async with await asyncio.start_unix_server(answer, path=str(endpoint)):
            port = free_port()
            env = {
                "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1",
                "OPENAI_API_KEY": "k" * 43,
                "STEADYRL_PROMPT": "12*34=",
                "CHECK": json.dumps(check or {}),
            }
            isolated = AgentIsolation(endpoint=(endpoint, port), **how)
            return await agent_programs.run([sys.executable, str(program)], env, isolated, seconds)

    return asyncio.run(asyncio.wait_for(main(), seconds + 30))


def _call_cgroup_possible() -> bool:
    group = cgroups.CallGroup.make(1 << 30, 64, 1.0)
    if group is None:
        return False
    group.close()
    return group.cpu_limited


FILES = """
import errno, json, os
check = json.loads(os.environ["CHECK"])
def attempt(change):
    try:
        change()
        return "changed"
    except OSError as exc:
        return errno.errorcode[exc.errno]
home = check["home"]
print(json.dumps({
    "visible": sorted(p for p in check["absent"] if os.path.lexists(p)),
    "home": sorted(os.listdir(home)) if os.path.isdir(home) else [],
    "root": sorted(os.listdir("/")),
    "own": open(os.path.join(os.path.dirname(__file__), "helper.txt")).read(),
    "extra": open(check["extra"]).read(),
    "hidden": os.listdir(check["hidden"]),
    "write_own": attempt(lambda: open(__file__, "a").write("x")),
    "write_tmp": attempt(lambda: open("/tmp/notes", "w").write("x")),
    "cwd": os.getcwd(),
    "env": sorted(os.environ),
}))
"""


def test_an_agent_program_sees_the_system_and_its_own_files_only(tmp_path):
    """Its own directory (read-only; a hidden directory in it empty), a file the recipe names
    (read_only_paths), its interpreter; not the home directory (beyond the interpreter's own directory when
    it lies there), ~/.ssh, /run, /var/run, /run/user, the run's directory, its token, the Redis password
    file, a sibling of its own directory, /etc/passwd or /etc/shadow."""
    home = os.path.realpath(os.path.expanduser("~"))
    bound = [sys.prefix, os.path.realpath(sys.base_prefix)]
    under_home = {Path(p).relative_to(home).parts[0] for p in bound if p.startswith(home + "/")}
    run_dir = tmp_path / "run"
    (run_dir / "keys").mkdir(parents=True)
    (run_dir / "token").write_text("the-run-token")
    (tmp_path / "redis-password").write_text("pw")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes").write_text("not the program's")
    (tmp_path / "agent" / "secret").mkdir(parents=True)
    (tmp_path / "agent" / "secret" / "key").write_text("hidden")
    (tmp_path / "agent" / "helper.txt").write_text("mine")
    (tmp_path / "data.txt").write_text("named by the recipe")
    absent = [
        *(os.path.join(home, name) for name in os.listdir(home) if name not in under_home),
        os.path.join(home, ".ssh"),
        "/run",
        "/var/run",
        "/run/user",
        "/var",
        "/home",
        "/etc/passwd",
        "/etc/shadow",
        str(run_dir),
        str(run_dir / "token"),
        str(tmp_path / "redis-password"),
        str(tmp_path / "other"),
    ]
    check = {
        "home": home,
        "absent": absent,
        "extra": str(tmp_path / "data.txt"),
        "hidden": str(tmp_path / "agent" / "secret"),
    }
    status, out, err = play(
        tmp_path,
        FILES,
        check,
        hidden=(run_dir, tmp_path / "redis-password", tmp_path / "agent" / "secret"),
        read_only=(tmp_path / "data.txt",),
    )
    assert status == 0, err
    seen = json.loads(out)
    assert seen["visible"] == []
    assert set(seen["home"]) <= under_home, seen["home"]
    tops = {Path(p).parts[1] for p in [*bound, str(tmp_path), os.getcwd()]}
    system = {".steadyrl", "bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
    assert set(seen["root"]) <= system | tops, seen["root"]
    assert (seen["own"], seen["extra"], seen["hidden"]) == ("mine", "named by the recipe", [])
    assert (seen["write_own"], seen["write_tmp"]) == ("EROFS", "changed")
    assert seen["cwd"] == os.getcwd()
    given = ["CHECK", "OPENAI_API_KEY", "OPENAI_BASE_URL", "STEADYRL_PROMPT"]
    assert seen["env"] == sorted([*given, "HOME", "LANG", "PATH", "PWD", "TMPDIR"])


NETWORK = """
import errno, json, os, socket, urllib.request
check = json.loads(os.environ["CHECK"])
def attempt(family, address):
    s = socket.socket(family)
    s.settimeout(5)
    try:
        s.connect(address)
        return "reached"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc))
    finally:
        s.close()
print(json.dumps({
    "host_loopback": attempt(socket.AF_INET, ("127.0.0.1", check["port"])),
    "host_address": attempt(socket.AF_INET, (check["address"], check["port"])) if check["address"] else "ENETUNREACH",
    "outside": attempt(socket.AF_INET, ("1.1.1.1", 53)),
    "unix": attempt(socket.AF_UNIX, check["unix"]),
    "abstract": attempt(socket.AF_UNIX, check["abstract"].encode("latin-1")),
    "interfaces": sorted(name for _, name in socket.if_nameindex()),
    "endpoint": urllib.request.urlopen(os.environ["OPENAI_BASE_URL"] + "/models", timeout=10).read().decode(),
}))
"""


def host_address() -> str:
    """One of this host's addresses beside loopback ("" when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the route's source address
        except OSError:
            return ""
        address = s.getsockname()[0]
    return "" if address.startswith("127.") else address


def test_an_agent_program_reaches_its_endpoint_and_nothing_else(tmp_path):
    """Its endpoint, at an ordinary OPENAI_BASE_URL on 127.0.0.1, answers; a service on the host's loopback,
    the host's other address, an address outside, a unix socket of the host and an abstract one do not
    (it has a loopback of its own and nothing else)."""
    abstract = f"\0steadyrl-agent-test-{uuid.uuid4().hex}"
    listeners = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX), socket.socket()]
    listeners[0].bind(str(tmp_path / "host.sock"))
    listeners[1].bind(abstract.encode("latin-1"))
    listeners[2].bind(("0.0.0.0", 0))
    for listener in listeners:
        listener.listen()
        listener.setblocking(False)
    check = {
        "port": listeners[2].getsockname()[1],
        "address": host_address(),
        "unix": str(tmp_path / "host.sock"),
        "abstract": abstract,
    }
    try:
        status, out, err = play(tmp_path, NETWORK, check)
        accepted = 0
        for listener in listeners:
            try:
                listener.accept()[0].close()
                accepted += 1
            except BlockingIOError:
                pass
    finally:
        for listener in listeners:
            listener.close()
    assert status == 0, err
    assert json.loads(out) == {
        "host_loopback": "ECONNREFUSED",
        "host_address": "ENETUNREACH",
        "outside": "ENETUNREACH",
        "unix": "ENOENT",
        "abstract": "ECONNREFUSED",
        "interfaces": ["lo"],
        "endpoint": "pong",
    }
    assert accepted == 0


@pytest.mark.skipif(platform.machine() not in NUMBERS, reason=f"no syscall numbers written for {platform.machine()}")
def test_every_denied_call_fails_inside_an_agent_program(tmp_path):
    status, out, err = play(tmp_path, PROBE.read_text())
    assert status == 0, err
    assert json.loads(out) == {name: "ENOSYS" if name == "clone3" else "EPERM" for name in NUMBERS[platform.machine()]}


@pytest.mark.skipif(not isolation.disables_userns(), reason="this bubblewrap has no --disable-userns")
def test_bubblewrap_alone_gives_an_agent_program_no_user_namespace():
    """Without the seccomp program, bubblewrap's --disable-userns still leaves no user namespace to make."""
    argv = AgentIsolation().argv([sys.executable, str(PROBE)], {}, None, 10, None)
    assert "--disable-userns" in argv and "--seccomp" not in argv
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert (seen["unshare"], seen["clone"], seen["clone3"]) == ("ENOSPC", "ENOSPC", "ENOSPC"), seen


ORDINARY = """
import os, subprocess, sys, threading, urllib.request
seen = []
threads = [threading.Thread(target=seen.append, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True)
shell = subprocess.run(["sh", "-c", "echo $((12 * 34))"], capture_output=True, text=True, check=True)
pong = urllib.request.urlopen(os.environ["OPENAI_BASE_URL"] + "/chat/completions", timeout=10).read().decode()
print(sorted(seen), child.stdout.strip(), shell.stdout.strip(), pong)
"""


def test_an_ordinary_agent_program_with_threads_and_processes_runs(tmp_path):
    status, out, err = play(tmp_path, ORDINARY)
    assert (status, out) == (0, "[0, 1, 2, 3, 4, 5, 6, 7] 42 408 pong\n"), err


LIMITS = """
import json, os, resource, subprocess, sys, time
what = json.loads(os.environ["CHECK"])["what"]
if what == "memory":
    held = b"x" * (400 << 20)
    print("allocated")
elif what == "processes":
    children = []
    for _ in range(30):
        try:
            children.append(subprocess.Popen(["sleep", "30"]))
        except OSError:
            break
    print(len(children))
    for child in children:
        child.kill()
elif what == "cpu":
    spin = "import time\\nend = time.monotonic() + 2\\nwhile time.monotonic() < end:\\n    pass"
    started = time.monotonic()
    for child in [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]:
        child.wait()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"cpu": usage.ru_utime + usage.ru_stime, "wall": time.monotonic() - started}))
else:
    names = ("RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_CPU", "RLIMIT_CORE")
    print(json.dumps({name: resource.getrlimit(getattr(resource, name))[0] for name in names}))
"""


@pytest.mark.skipif(not _call_cgroup_possible(), reason="no cgroup with memory, pids and cpu can be made here")
def test_an_agent_program_is_held_to_its_memory_processes_and_cpu(tmp_path):
    """Its cgroup: 400 MB written past a 128 MB limit kill it; at most 8 processes (bubblewrap's own
    not counted) hold 30 children to fewer than 8; two processes spinning for 2 s at 0.1 CPUs use at most
    0.1 s of CPU time a second, over the time they took (and a period's slack; unlimited, they use what two
    cores give, 0.3 s a second or more even on a busy machine)."""
    how = {"memory_bytes": 128 << 20, "max_processes": 8, "cpus": 0.1}
    memory = play(tmp_path, LIMITS, {"what": "memory"}, **how)
    processes = play(tmp_path, LIMITS, {"what": "processes"}, **how)
    cpu = play(tmp_path, LIMITS, {"what": "cpu"}, **how)
    assert memory[0] == 128 + 9 and "allocated" not in memory[1], memory  # SIGKILL by the cgroup's OOM killer
    assert processes[0] == 0 and 1 <= int(processes[1]) < 8, processes
    assert cpu[0] == 0, cpu
    used = json.loads(cpu[1])
    assert used["cpu"] < 0.1 * used["wall"] + 0.1, used


def test_without_a_cgroup_an_agent_program_gets_rlimits(tmp_path, monkeypatch):
    """Where no cgroup can be made: its address space, processes (for a replica not running as root), CPU
    seconds (cpus × its time limit, and one) and no core dumps, per process."""
    monkeypatch.setattr(cgroups.CallGroup, "make", classmethod(lambda cls, *a, **k: None))
    how = {"memory_bytes": 256 << 20, "max_processes": 8, "cpus": 0.5}
    status, out, err = play(tmp_path, LIMITS, {"what": "rlimits"}, seconds=20, **how)
    assert status == 0, err
    assert json.loads(out) == {"RLIMIT_AS": 256 << 20, "RLIMIT_NPROC": 8, "RLIMIT_CPU": 11, "RLIMIT_CORE": 0}
    memory = play(tmp_path, LIMITS, {"what": "memory"}, seconds=20, **how)
    assert memory[0] == 1 and "MemoryError" in memory[2], memory
