"""The compose run under `scripts/containers`, checked from outside its containers: the run trains to
its end with every rollout trained once, replicas serve the last version, healthchecks pass, none but
Redis runs as root, Prometheus scrapes every target, published ports bind loopback, dashboards and
alert rules evaluate. --fault injects one fault mid-run first; --pools runs a recipe's teacher and
judge pools; --agents checks that an agent program in a replica container runs isolated and reads
none of its secrets. Prints one JSON object; exit 1 on a failed check. Each check in full:
docs/guides/deploy-compose.md."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTROL = "http://127.0.0.1:8080"
PROMETHEUS = "http://127.0.0.1:9090"
# dashboard panels whose series exist only once something went wrong, or only with an engine or
# profile this run does not start
FAULT_ONLY = {
    "steadyrl_orchestrator_policy_eval_accuracy": "π's eval: the policy-eval profile is off",
    "steadyrl_trainer_rollouts_dead_lettered_total": "rollouts dead-lettered: none in a healthy run",
    "steadyrl_trainer_publish_failures_total": "publish failures: none in a healthy run",
    "steadyrl_weightsync_failures_total": "weight-sync failures: none in a healthy run",
    "steadyrl_inference_leases_lost_total": "leases lost: none in a healthy run",
    "vllm:": "vLLM's own metrics: the compose recipe runs the torch engine",
    "steadyrl_weightsync_pull_seconds": "pulls from weight-sync: every version reached the replicas by the collective",
    "steadyrl_pool_failures_total": "pool failures: none in a healthy run",
    "steadyrl_inference_teacher_failures_total": "teacher pool failures: none in a healthy run",
    "steadyrl_inference_judge_failures_total": "judge pool failures: none in a healthy run",
}
# and those of a teacher or judge pool, which only a run with --pools starts
POOLS_ONLY = {
    "steadyrl_pool_": "teacher and judge pools: the compose recipe declares none",
    "judge_agreement|teacher_gap": "judge agreement and teacher gap: the compose recipe has no pool",
}


def podman(*args: str, check: bool = True) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: {done.stderr.strip()[-500:]}")
    return done.stdout


def containers(project: str) -> dict[str, dict]:
    """name → podman's inspect of each container of the project."""
    names = podman("ps", "-a", "--filter", f"label=io.podman.compose.project={project}", "--format", "{{.Names}}")
    return {name: json.loads(podman("inspect", name))[0] for name in names.split()}


def service_of(info: dict) -> str:
    return info["Config"]["Labels"].get("com.docker.compose.service", "")


def get(url: str, token: str | None = None, timeout: float = 10.0) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def promql(expr: str, at: float | None = None) -> list[dict]:
    query = {"query": expr, **({"time": str(at)} if at else {})}
    reply = get(f"{PROMETHEUS}/api/v1/query?{urllib.parse.urlencode(query)}")
    if reply.get("status") != "success":
        raise RuntimeError(f"PromQL {expr!r}: {reply}")
    return reply["data"]["result"]


def wait_status(token: str, until, deadline: float, what: str) -> dict:
    """The control plane's /v1/run once `until(status)` holds (bounded by `deadline`)."""
    last: dict | str = "no answer yet"
    while time.monotonic() < deadline:
        try:
            last = get(f"{CONTROL}/v1/run", token)
            if until(last):
                return last
        except OSError as exc:  # the orchestrator still starting, or restarting
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(2)
    raise TimeoutError(f"{what}: not within the time allowed; last status {str(last)[:800]}")


def inject(fault: str, project: str, token: str, deadline: float) -> dict:
    """One fault at step ≥ 10: what was done, and when."""
    wait_status(token, lambda s: s.get("trainer_step", 0) >= 10, deadline, "step 10 before the fault")
    by_service: dict[str, list[str]] = {}
    for name, info in containers(project).items():
        by_service.setdefault(service_of(info), []).append(name)
    if fault == "trainer":  # a crash, not a stop: SIGKILL to its process, so the restart policy applies
        name = by_service["trainer"][0]
        pid = json.loads(podman("inspect", name))[0]["State"]["Pid"]
        subprocess.run(["kill", "-KILL", str(pid)], check=True)
        restarts = 0
        while time.monotonic() < deadline and restarts == 0:
            time.sleep(2)
            restarts = json.loads(podman("inspect", name))[0].get("RestartCount", 0)
        return {"fault": "trainer process killed (SIGKILL)", "container": name, "restarts": restarts}
    if fault == "inference":
        name = sorted(by_service["inference"])[0]
        podman("kill", name)  # stopped for good: the other replica carries the run
        return {"fault": "one inference container killed", "container": name}
    if fault == "redis":
        name = by_service["redis"][0]
        podman("stop", "-t", "5", name)
        time.sleep(10)
        podman("start", name)
        return {"fault": "Redis stopped for 10 s, then started", "container": name}
    raise ValueError(f"unknown fault {fault!r}")


def check_prometheus(result: dict, failures: list[str], during: float, ended: float, run: str, pools: bool) -> None:
    """Targets as of `during` (a moment of the run), each dashboard expression then or at `ended` (a
    rate over a window needs two scrapes of a series: a short run may end before a late series has
    them at `during`), alert rules now (after its end)."""
    up = promql("up", during)
    result["targets"] = sorted(f"{s['metric'].get('job')} {s['metric'].get('instance')} up={s['value'][1]}" for s in up)
    killed = bool(result["fault"]) and "inference" in result["fault"]["fault"]
    for series in up:
        if series["metric"].get("run") != run:
            failures.append(f"target unlabelled: {series['metric']}")
        elif series["value"][1] != "1" and not (killed and series["metric"].get("job") == "steadyrl-inference"):
            failures.append(f"target down: {series['metric']}")  # (the killed replica's may be, in its fault)
    jobs = {s["metric"].get("job") for s in up}
    for job in ("steadyrl-weightsync", "steadyrl-trainer", "steadyrl-orchestrator", "steadyrl-inference"):
        if job not in jobs:
            failures.append(f"no target of {job}")
    replicas = 1 if killed else 2
    if sum(1 for s in up if s["metric"].get("job") == "steadyrl-inference") < replicas:
        failures.append(f"fewer than {replicas} inference targets scraped")
    published = promql(f'sum by (replica) (steadyrl_inference_rollouts_sent_total{{run="{run}"}})', during)
    result["rollouts_published_by_replica"] = {s["metric"].get("replica"): float(s["value"][1]) for s in published}
    if sum(1 for value in result["rollouts_published_by_replica"].values() if value > 0) < replicas:
        failures.append(f"fewer than {replicas} replicas leased and published work")
    if pools:  # each pool answered the replicas (a pool's replicas publish no rollouts)
        served = promql(f'sum by (pool) (steadyrl_pool_requests_total{{run="{run}"}})', during)
        result["pool_requests"] = {s["metric"].get("pool"): float(s["value"][1]) for s in served}
        failures.extend(
            f"the {p} pool served no request" for p in ("teacher", "judge") if not result["pool_requests"].get(p)
        )
    excuses = FAULT_ONLY if pools else FAULT_ONLY | POOLS_ONLY
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/steadyrl.json").read_text())
    empty, excused = [], []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$run", run)
            if promql(expr, during) or promql(expr, ended):
                continue
            why = next((why for key, why in excuses.items() if key in expr), None)
            (excused if why else empty).append(f"{panel.get('title')}: {why or expr}")
    result["dashboard_expressions_without_series"] = {"excused": excused, "empty": empty}
    failures.extend(f"dashboard expression returned no series: {e}" for e in empty)
    rules = get(f"{PROMETHEUS}/api/v1/rules")["data"]["groups"]
    evaluated = [r for g in rules for r in g["rules"]]
    result["alert_rules"] = len(evaluated)
    for rule in evaluated:
        if rule.get("health") != "ok":
            failures.append(f"alert rule {rule['name']} health={rule.get('health')}: {rule.get('lastError')}")
        if rule.get("state") == "firing":  # an info alert reports (stale drops); any other is a failure
            severity = rule.get("labels", {}).get("severity", "")
            result.setdefault("alerts_firing", []).append(f"{rule['name']} ({severity})")
            if severity != "info" and not result["fault"]:  # after a fault, listed (it may be the fault's)
                failures.append(f"alert {rule['name']} ({severity}) firing at the end of a healthy run")


def probe(command: list[str]) -> dict:
    """scripts/containers_agent_probe.py run by `command` (podman exec or run, reading it on stdin)."""
    script = (ROOT / "scripts" / "containers_agent_probe.py").read_text()
    done = subprocess.run(command, input=script, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return {"exit": done.returncode, **(json.loads(lines[-1]) if lines else {"stderr": done.stderr[-2000:]})}


def check_agents(project: str, deadline: float) -> dict:
    """Agent programs in the replica's container as compose runs it (its security options, its
    secrets): isolated, no secret read. Then the same image, user and environment under the runtime's
    default profile (Docker's and containerd's: deploy/seccomp/runtime-default.json) and under the
    shipped profile with /proc masked: both refused, so the shipped options are what isolates them."""
    replica = None
    while replica is None and time.monotonic() < deadline:
        running = [n for n, i in containers(project).items() if service_of(i) == "inference" and i["State"]["Running"]]
        replica = sorted(running)[0] if running else None
        if replica is None:
            time.sleep(2)
    if replica is None:
        return {"failures": ["no inference container running"]}
    info = containers(project)[replica]
    result: dict = {"container": replica, "security_opt": info["HostConfig"].get("SecurityOpt")}
    result["shipped"] = probe(["podman", "exec", "-i", replica, "python", "-"])
    env = [a for e in info["Config"]["Env"] for a in ("-e", e)]
    run = ["podman", "run", "--rm", "-i", "--pull=never", "--user", "10001", "--read-only", "--tmpfs", "/tmp"]
    run += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges", *env, "--entrypoint", "python"]
    default = str(ROOT / "deploy" / "seccomp" / "runtime-default.json")
    shipped = str(ROOT / "deploy" / "seccomp" / "agents.json")
    variants = {
        "runtime_default_profile": ["--security-opt", f"seccomp={default}", "--security-opt", "systempaths=unconfined"],
        "shipped_profile_proc_masked": ["--security-opt", f"seccomp={shipped}"],
    }
    for name, options in variants.items():
        result[name] = probe([*run, *options, info["ImageName"], "-"])
    failures = [f"shipped: {f}" for f in result["shipped"].get("failures", ["no report"])]
    if result["shipped"].get("refused"):
        failures.append(f"shipped: agent programs refused: {result['shipped']['refused']}")
    failures += [f"{name}: agent programs were not refused" for name in variants if not result[name].get("refused")]
    result["failures"] = failures
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--project", required=True)
    parser.add_argument("--env-file", type=Path, required=True)
    parser.add_argument("--fault", choices=["trainer", "inference", "redis"])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--run-id", default="tiny-arith", help="the recipe's [run] id: every series' run label")
    parser.add_argument("--pools", action="store_true", help="the recipe's teacher and judge pools must serve")
    parser.add_argument("--agents", action="store_true", help="agent programs in a replica's container: no run")
    args = parser.parse_args()
    if args.agents:
        result = check_agents(args.project, time.monotonic() + args.minutes * 60)
        print(json.dumps(result, indent=2))
        return 1 if result["failures"] else 0
    env = dict(line.split("=", 1) for line in args.env_file.read_text().splitlines() if "=" in line)
    token = env["STEADYRL_TOKEN"]
    deadline = time.monotonic() + args.minutes * 60
    started = time.monotonic()
    result: dict = {"fault": None}
    failures: list[str] = []
    if args.fault:
        result["fault"] = inject(args.fault, args.project, token, deadline)
    # the dashboard and the targets are read as of three quarters of the run (the trainer exits at its end)
    recipe_set = dict(s.split("=", 1) for s in env.get("STEADYRL_RECIPE_SET", "").split(";") if "=" in s)
    steps = int(recipe_set.get("run.steps", 400))
    wait_status(token, lambda s: s.get("trainer_step", 0) >= steps * 3 // 4, deadline, "three quarters of the run")
    during = time.time()
    status = wait_status(token, lambda s: s.get("state") in ("finished", "failed", "stopped"), deadline, "the run")
    ended = time.time()
    result["run_seconds"] = round(time.monotonic() - started, 1)
    result["state"] = status["state"]
    result["steps"] = status.get("trainer_step")
    result["progress"] = status.get("progress")
    result["replica_versions"] = status.get("replica_versions")
    result["evals"] = status.get("evals", {})  # version → greedy eval accuracy
    progress = status.get("progress", {})
    if status["state"] != "finished":
        failures.append(f"the run ended {status['state']}")
    # every task trained once, dropped as staler than the budget or filtered (counted), none lost or dead
    settled = sum(progress.get(k, 0) for k in ("trained", "dropped", "filtered"))
    if settled != progress.get("submitted") or progress.get("dead"):
        failures.append(f"not every rollout trained once: {progress}")
    live = {info["Id"][:12] for info in containers(args.project).values() if service_of(info) == "inference"}
    versions = {r: v for r, v in status.get("replica_versions", {}).items() if r.rsplit("-", 1)[0] in live}
    serving = {r: v for r, v in versions.items() if v == status.get("trainer_version")}
    if len(serving) < (1 if args.fault == "inference" else 2):
        failures.append(f"replicas on the last version {status.get('trainer_version')}: {versions}")
    # the trainer exits after its last publish and checkpoint, which "finished" may precede by seconds
    trainer_deadline = time.monotonic() + 120
    while any(service_of(i) == "trainer" and i["State"]["Running"] for i in containers(args.project).values()):
        if time.monotonic() > trainer_deadline:
            failures.append("the trainer still runs 120 s after the run finished")
            break
        time.sleep(2)
    health, users, published = {}, {}, {}
    bind = env.get("STEADYRL_BIND_ADDRESS") or "127.0.0.1"  # compose's default: loopback alone
    for name, info in containers(args.project).items():
        service = service_of(info)
        users[name] = info["Config"].get("User") or "root"
        for port, bindings in (info["HostConfig"].get("PortBindings") or {}).items():
            for binding in bindings or []:
                published[f"{name} {port}"] = f"{binding.get('HostIp') or '*'}:{binding.get('HostPort')}"
                if (binding.get("HostIp") or "0.0.0.0") != bind:
                    failures.append(f"{name} publishes {port} on {binding.get('HostIp') or 'every address'}")
        check = (info["Config"].get("Healthcheck") or {}).get("Test") or ["NONE"]
        if info["State"]["Running"] and check != ["NONE"]:
            ran = subprocess.run(["podman", "healthcheck", "run", name], capture_output=True, text=True, timeout=60)
            health[name] = "healthy" if ran.returncode == 0 else f"unhealthy: {ran.stdout.strip()}{ran.stderr.strip()}"
            if ran.returncode != 0:
                failures.append(f"{name}: healthcheck failed")
        if service != "redis" and users[name] in ("", "root", "0", "0:0"):
            failures.append(f"{name} runs as root")
    result["healthchecks"] = health
    result["users"] = users
    result["published"] = published
    time.sleep(15)  # one more scrape and rule evaluation after the end (the interval is 10 s)
    check_prometheus(result, failures, during, ended, args.run_id, args.pools)
    result["failures"] = failures
    print(json.dumps(result, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
