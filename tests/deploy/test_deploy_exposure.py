"""What the shipped deployments expose, checked for real where it can be run here: compose publishes its
ports on loopback unless STEADYRL_BIND_ADDRESS widens them; every secret left at deploy/env.example's
placeholder stops the service that reads it (`steadyrl serve`, and Grafana's entrypoint) with the
command that makes a real one; Redis's healthcheck, run against a real redis-server, keeps the password
out of redis-cli's argv; and the Kubernetes NetworkPolicies, evaluated connection by connection,
admit only what must talk, on its ports alone."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shared.runstore.redis_server import RedisServer, redis_server_binary
from tests.deploy.test_compose_run import placed
from tests.deploy.test_deploy import DEPLOY, ROOT, compose, render, workloads

PUBLISHED = {"orchestrator": 8080, "prometheus": 9090, "alertmanager": 9093, "grafana": 3000}


def interpolated(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR} under `env`; `$$` is a literal `$`."""

    def one(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        return env.get(name) or (default or "")

    return re.sub(r"\$\{([A-Z0-9_]+)(?::-([^}]*))?\}", one, value).replace("$$", "$")


def published(env: dict[str, str]) -> dict[str, list[tuple[str, int, int]]]:
    """service → (host address, host port, container port) of each port it publishes."""
    out = {}
    for name, service in compose()["services"].items():
        for spec in service.get("ports", []):
            address, host, container = interpolated(str(spec), env).rsplit(":", 2)
            out.setdefault(name, []).append((address, int(host), int(container)))
    return out


def test_compose_publishes_every_port_on_loopback_unless_widened():
    from compose_spec import PyCompose

    ports = published({})
    assert {name: [p[1] for p in specs] for name, specs in ports.items()} == {k: [v] for k, v in PUBLISHED.items()}
    assert {p[0] for specs in ports.values() for p in specs} == {"127.0.0.1"}
    widened = published({"STEADYRL_BIND_ADDRESS": "0.0.0.0"})
    assert {p[0] for specs in widened.values() for p in specs} == {"0.0.0.0"}
    doc = compose()
    for name, specs in widened.items():  # still valid compose once interpolated
        doc["services"][name]["ports"] = [f"{a}:{h}:{c}" for a, h, c in specs]
    PyCompose.from_json(json.dumps(doc))
    example = (DEPLOY / "env.example").read_text()
    assert re.search(r"^# STEADYRL_BIND_ADDRESS=0\.0\.0\.0$", example, re.M)  # documented where secrets are set
    assert "STEADYRL_BIND_ADDRESS" in (ROOT / "docs" / "guides" / "deploy-compose.md").read_text()


def example_values() -> dict[str, str]:
    lines = (DEPLOY / "env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


# each secret of compose, the service whose start reads it, and the command a refusal names
READERS = {
    "token": ("weightsync", "steadyrl secret"),
    "redis_password": ("orchestrator", "steadyrl secret"),
    "weights_signing_key": ("trainer", "steadyrl keys"),
    "weights_verify_key": ("inference", "steadyrl keys"),
}


def start_with(secret: str, content: str, tmp_path, tiny_model_dir):
    """The service that reads `secret` started as compose starts it, that secret's file holding
    `content` and every other a real value: (the finished process, the real values)."""
    doc = compose()
    service_name, _ = READERS[secret]
    service = doc["services"][service_name]
    assert secret in service["secrets"]
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    real = {name: f"real-{name}-0123456789abcdef" for name in doc["secrets"]}
    for name in service["secrets"]:
        (secrets / name).write_text((content if name == secret else real[name]) + "\n")
    paths = {"/run/secrets": str(secrets), "/models/tiny": str(tiny_model_dir), "/spill": str(tmp_path / "spill")}
    paths |= {"/home/steadyrl/runs": str(tmp_path), "/tmp/steadyrl-cache": str(tmp_path / "cache")}
    paths |= {"/etc/steadyrl/": str(ROOT / "configs") + "/"}
    env = placed(service["environment"], {}, paths) | {"HOME": str(tmp_path)}
    base = {k: v for k, v in os.environ.items() if not k.startswith("STEADYRL_")}
    done = subprocess.run(
        [sys.executable, "-m", *service["command"]],
        env=base | env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return done, real


@pytest.mark.parametrize("secret", sorted(READERS))
def test_a_placeholder_secret_stops_the_service_that_reads_it_naming_the_command(secret, tmp_path, tiny_model_dir):
    placeholder = example_values()[compose()["secrets"][secret]["environment"]]
    done, real = start_with(secret, placeholder, tmp_path, tiny_model_dir)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])  # refused: nothing started
    assert "event=settings_refused" in done.stderr and "deploy/env.example's placeholder" in done.stderr
    assert f"/{secret}" in done.stderr and f"`{READERS[secret][1]}" in done.stderr, done.stderr[-1000:]
    assert not any(value in done.stdout + done.stderr for value in real.values())  # no secret echoed


@pytest.mark.parametrize("secret", ["token", "redis_password"])
def test_an_empty_secret_stops_the_service_instead_of_turning_its_check_off(secret, tmp_path, tiny_model_dir):
    """An empty STEADYRL_TOKEN in .env gives compose an empty secret file: read as "no token", every
    gRPC server would have started without asking for one."""
    done, real = start_with(secret, "", tmp_path, tiny_model_dir)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "event=settings_refused" in done.stderr and f"/{secret}) is empty, not a secret" in done.stderr
    assert not any(value in done.stdout + done.stderr for value in real.values())


def test_every_secret_of_env_example_is_a_placeholder_the_services_refuse(tmp_path, monkeypatch):
    from shared.rpc.auth import token_from_env
    from shared.rpc.secret_files import PlaceholderSecret, is_placeholder, read_secret

    values = example_values()
    secrets = {s["environment"] for s in compose()["secrets"].values()}
    assert secrets <= set(values)
    assert all(is_placeholder(values[variable]) for variable in secrets), values
    assert not is_placeholder("a-real-token-that-says-change-me-inside")
    token = tmp_path / "token"
    token.write_text(values["STEADYRL_TOKEN"] + "\n")
    with pytest.raises(PlaceholderSecret, match="`steadyrl secret`"):
        read_secret(token, "the token")
    monkeypatch.setenv("STEADYRL_TOKEN_FILE", str(token))
    with pytest.raises(PlaceholderSecret):  # where every gRPC server and client reads it
        token_from_env()
    token.write_text(" \n")
    with pytest.raises(PlaceholderSecret, match=r"STEADYRL_TOKEN_FILE \(.*\) is empty, not a secret"):
        token_from_env()  # an empty file is no way to turn the token off
    token.write_text("a-real-token\n")
    assert token_from_env() == "a-real-token"


def grafana_entrypoint() -> list[str]:
    entrypoint = compose()["services"]["grafana"]["entrypoint"]
    return [interpolated(part, {}) for part in entrypoint]


@pytest.mark.parametrize(
    "password,refused", [("change-me-three", True), ("", True), ("a-real-password-0123456789", False)]
)
def test_grafana_refuses_env_example_s_placeholder_before_it_starts(password, refused, tmp_path):
    """Compose's entrypoint for Grafana, run by sh: a placeholder (or nothing) exits 2 naming the command;
    a real password goes on to Grafana's own /run.sh (absent here: exit 127, not found)."""
    shell = shutil.which("sh")
    secret = tmp_path / "grafana_admin_password"
    secret.write_text(password)
    env = {"PATH": os.environ["PATH"], "GF_SECURITY_ADMIN_PASSWORD__FILE": str(secret)}
    argv = grafana_entrypoint()
    assert argv[:2] == ["sh", "-c"]
    done = subprocess.run([shell, *argv[1:]], env=env, capture_output=True, text=True, timeout=30)
    if refused:
        assert done.returncode == 2 and "placeholder" in done.stderr and "steadyrl secret" in done.stderr
    else:
        assert done.returncode == 127 and "/run.sh" in done.stderr, (done.returncode, done.stderr)
    assert compose()["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == (
        "/run/secrets/grafana_admin_password"
    )


def test_the_redis_healthcheck_keeps_the_password_out_of_argv(tmp_path):
    """Compose's healthcheck command run by sh against a real redis-server with its password; redis-cli is
    reached through a stand-in on PATH that records the argv and environment it was given, then runs the
    real one at the server's port."""
    check = compose()["services"]["redis"]["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL"
    password = "pw-" + os.urandom(8).hex()
    secret = tmp_path / "redis_password"
    secret.write_text(password)
    command = interpolated(check[1], {}).replace("/run/secrets/redis_password", str(secret))
    cli = shutil.which("redis-cli") or str(Path(redis_server_binary()).with_name("redis-cli"))
    record = tmp_path / "record"
    shim = tmp_path / "bin" / "redis-cli"
    shim.parent.mkdir()
    shim.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > "{record}.argv"\n'
        f'printf "%s" "${{REDISCLI_AUTH-unset}}" > "{record}.auth"\n'
        f'exec "{cli}" -p "$PORT" "$@"\n'
    )
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    with RedisServer(tmp_path / "redis", password=password) as redis:
        env = {"PATH": f"{shim.parent}:{os.environ['PATH']}", "PORT": str(redis.port)}
        done = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and "PONG" in done.stdout, (done.stdout, done.stderr)  # it does authenticate
        secret.write_text("a-wrong-password")
        wrong = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True, timeout=30)
        assert wrong.returncode != 0  # and fails without the right password: the check checks
    secret.write_text(password)
    argv = Path(f"{record}.argv").read_text()
    assert password not in argv and "-a" not in argv.split() and "ping" in argv.split()
    assert password not in command  # nor in the shell's own argv
    assert Path(f"{record}.auth").read_text() in (password, "a-wrong-password")  # REDISCLI_AUTH carried it


# --- Kubernetes NetworkPolicies --------------------------------------------------------------------


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions In / NotIn / Exists / DoesNotExist) on `labels`."""
    if selector is None:
        return False
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, op, values = expression["key"], expression["operator"], expression.get("values", [])
        held = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not held:
            return False
    return True


NAMESPACE = {"kubernetes.io/metadata.name": "steadyrl"}


def admitted(policies: list[dict], source: tuple[dict, dict], target: dict, port: int) -> bool:
    """Whether a TCP connection from `source` (its namespace's labels, its pod's) reaches a pod of the
    steadyrl namespace labelled `target` on `port`: every policy selecting the target for Ingress, and
    (a source in the namespace) every one selecting the source for Egress, must admit it in one rule."""
    namespace, pod = source

    def peer_matches(peer: dict, labels: dict, their_namespace: dict) -> bool:
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], their_namespace):
                return False
            return selects(peer.get("podSelector", {}), labels)
        return their_namespace == NAMESPACE and selects(peer["podSelector"], labels)

    def port_matches(rule: dict) -> bool:
        return not rule.get("ports") or any(
            p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
            for p in rule["ports"]
        )

    def allowed(direction: str, selected: dict, peer_labels: dict, peer_namespace: dict) -> bool:
        key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        chosen = [p for p in policies if direction in p["policyTypes"] and selects(p["podSelector"], selected)]
        if not chosen:
            return True
        return any(
            port_matches(rule)
            and (not rule.get(peers) or any(peer_matches(x, peer_labels, peer_namespace) for x in rule[peers]))
            for policy in chosen
            for rule in policy.get(key, [])
        )

    inbound = allowed("Ingress", target, pod, namespace)
    outbound = namespace != NAMESPACE or allowed("Egress", pod, target, NAMESPACE)
    return inbound and outbound


def pod(app: str) -> tuple[dict, dict]:
    return NAMESPACE, {"app": app}


ELSEWHERE = ({"kubernetes.io/metadata.name": "default"}, {"app": "anything"})
CONTROL = ({"kubernetes.io/metadata.name": "ingress-nginx", "steadyrl.io/control-plane": "true"}, {"app": "nginx"})
MONITORING = ({"kubernetes.io/metadata.name": "monitoring"}, {"app": "prometheus"})
# (from, to, port, admitted): what must talk does, on its port; the rest is refused
EXPECTED = [
    (ELSEWHERE, "orchestrator", 8080, False),  # the control plane: not from any namespace
    (CONTROL, "orchestrator", 8080, True),  # from those labelled for it
    (MONITORING, "orchestrator", 8080, True),  # its /metrics
    (pod("inference"), "orchestrator", 8080, False),
    (pod("inference"), "orchestrator", 50054, True),
    (pod("trainer"), "orchestrator", 50054, False),
    (pod("orchestrator"), "trainer", 50053, True),
    (pod("inference"), "trainer", 50053, False),  # a replica never calls the trainer
    (pod("weightsync"), "trainer", 50053, False),
    (pod("trainer"), "weightsync", 50051, True),
    (pod("inference"), "weightsync", 50051, True),
    (pod("inference-policy"), "weightsync", 50051, True),
    (pod("orchestrator"), "weightsync", 50051, False),
    (pod("inference-judge"), "weightsync", 50051, False),  # a pool's weights are fixed
    (pod("inference"), "weightsync", 9101, False),  # metrics: monitoring's alone
    (pod("trainer"), "inference", 9102, False),
    (MONITORING, "inference", 9102, True),
    (pod("trainer"), "inference", 40000, True),  # the collective's listeners
    (pod("weightsync"), "trainer", 40999, True),
    (pod("inference"), "weightsync", 40500, True),
    (pod("inference"), "trainer", 39999, False),  # outside their range
    (pod("inference"), "trainer", 41000, False),
    (pod("orchestrator"), "inference", 40000, False),
    (pod("trainer"), "trainer", 29400, True),  # a multi-node trainer's own rendezvous and NCCL
    (pod("inference"), "redis", 6379, True),
    (pod("weightsync"), "redis", 6379, True),  # the run's instance
    (pod("inference"), "inference-judge", 50052, True),
    (pod("trainer"), "inference-judge", 50052, False),
    (pod("inference"), "inference", 50052, False),
    (ELSEWHERE, "weightsync", 50051, False),
]


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_network_policies_admit_only_what_must_talk_on_its_ports(overlay):
    docs = render(overlay)
    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy"]
    labels = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in workloads(docs).items()}
    labels.setdefault("inference-judge", {**labels["inference"], "app": "inference-judge"})  # components/judge-pool's
    wrong = [
        (src[1].get("app"), to, port, want)
        for src, to, port, want in EXPECTED
        if admitted(policies, src, labels[to], port) != want
    ]
    assert wrong == []  # (from, to, port, what should have been)
    # the collective's ports are the ones its members' pods draw listeners from
    collective = next(
        d["spec"] for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "weights-collective"
    )
    ports = collective["ingress"][0]["ports"][0]
    for name, workload in workloads(docs).items():
        template = workload["spec"]["template"]
        if selects(collective["podSelector"], template["metadata"]["labels"]):
            sysctls = {s["name"]: s["value"] for s in template["spec"]["securityContext"].get("sysctls", [])}
            assert sysctls.get("net.ipv4.ip_local_port_range") == f"{ports['port']} {ports['endPort']}", name


def test_the_evaluation_is_not_blind():
    """The evaluator admits what an open policy admits: the default-deny alone refuses, an allow-all admits."""
    deny = [{"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}]
    assert not admitted(deny, pod("inference"), {"app": "trainer"}, 50053)
    allow = deny + [{"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "ingress": [{}], "egress": [{}]}]
    assert admitted(allow, ELSEWHERE, {"app": "orchestrator"}, 8080)
    assert admitted(allow, pod("inference"), {"app": "trainer"}, 50053)


GLOO = """
import datetime, os, sys, torch, torch.distributed as dist
rank, port = int(sys.argv[1]), int(sys.argv[2])
wait = datetime.timedelta(seconds=60)
group = dist.ProcessGroupGloo(dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=wait), rank, 2, wait)
group.broadcast([torch.ones(4)]).wait()
listening = [line.split() for path in ("/proc/net/tcp", "/proc/net/tcp6") for line in open(path).readlines()[1:]]
ports = sorted({int(f[1].rsplit(":", 1)[1], 16) for f in listening if f[3] == "0A"} - {port})
os.write(1, f"{ports}\\n".encode())  # one write: the two ranks share the pipe and print() writes twice
group.barrier().wait()
"""


def test_gloo_listens_on_the_ports_the_collective_policy_admits(tmp_path):
    """The policy's range holds because gloo's listeners take the kernel's ephemeral ports: two real gloo
    ranks in a network namespace of their own with the pods' sysctl listen inside the range alone."""
    docs = render("cpu")
    pod = workloads(docs)["weightsync"]["spec"]["template"]["spec"]
    value = {s["name"]: s["value"] for s in pod["securityContext"]["sysctls"]}["net.ipv4.ip_local_port_range"]
    low, high = map(int, value.split())
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if os.geteuid() != 0 or unshare is None or ip is None:
        pytest.skip("a network namespace of its own needs root, unshare and ip")
    script = tmp_path / "gloo.py"
    script.write_text(GLOO)
    inner = (
        f'{ip} link set lo up && echo "{low} {high}" > /proc/sys/net/ipv4/ip_local_port_range && '
        f"{{ {sys.executable} {script} 0 29555 & first=$!; {sys.executable} {script} 1 29555; second=$?; "
        'wait "$first" && exit "$second"; }'
    )
    done = subprocess.run([unshare, "--net", "sh", "-c", inner], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    listened = {port for line in done.stdout.splitlines() for port in json.loads(line)}
    assert listened and all(low <= port <= high for port in listened), (listened, value)
