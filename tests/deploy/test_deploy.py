"""Deploy files, validated offline for real: the compose specification, the services' settings,
kustomize renders checked against the Kubernetes schemas, the custom resources against their CRDs'
schemas (deploy/schemas), promtool, a live Prometheus scraping a running service, and a dashboard
that only names metrics the services export."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shared.queues import QueueDepths
from shared.redis_server import free_port
from steadyrl.service_settings import validate

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SERVICE_OF = {"services.weightsync": "weightsync", "services.trainer": "trainer", "services.inference": "inference",
              "services.orchestrator": "orchestrator"}


def steadyrl_env(env: dict[str, str], service: str) -> dict[str, str]:
    prefix = f"STEADYRL_{service.upper()}_"
    return {k: re.sub(r"\$\{?\(?REDIS_PASSWORD\)?\}?", "pw", str(v)) for k, v in env.items() if k.startswith(prefix)}


def check_settings(service: str, env: dict[str, str]) -> None:
    # model_path is required by three services; a probe value stands in where a manifest mounts it
    validate(service, {f"STEADYRL_{service.upper()}_MODEL_PATH": "/models/tiny", **env}
             if service != "weightsync" else env)


# --- docker compose ------------------------------------------------------------------------------

def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # resolves the x-steadyrl merge keys


def test_compose_follows_the_specification():
    from compose_spec import PyCompose

    spec = PyCompose.from_json(json.dumps(compose())).to_dict()
    assert set(spec["services"]) == {"redis", "model-init", "weightsync", "trainer", "inference", "inference-policy",
                                     "orchestrator", "prometheus", "grafana"}
    assert spec["services"]["inference-policy"]["profiles"] == ["policy-eval"]  # off unless asked for
    with pytest.raises(ValueError, match="imagee"):  # the validator does reject what the spec does not allow
        PyCompose.from_json(json.dumps({"services": {"a": {"image": "x", "imagee": "y"}}}))


def test_compose_env_matches_the_settings_and_secrets_stay_out():
    doc = compose()
    checked = 0
    for name, service in doc["services"].items():
        module = (service.get("command") or [""])[0]
        if module not in SERVICE_OF:
            continue
        kind = SERVICE_OF[module]
        env = steadyrl_env(service.get("environment", {}), kind)
        assert env, name
        check_settings(kind, env)
        checked += 1
        assert service["env_file"] == ".env" and "STEADYRL_HEALTH_PORT" in service["environment"]
    assert checked == 5
    assert "ports" not in doc["services"]["inference"]  # `--scale inference=N` needs no fixed host port
    assert doc["services"]["orchestrator"]["environment"]["STEADYRL_ORCHESTRATOR_AUTOSTART"] == "true"  # no manual start
    assert "--appendonly yes" in " ".join(doc["services"]["redis"]["command"])
    assert "--requirepass" in " ".join(doc["services"]["redis"]["command"])
    example = dict(line.split("=", 1) for line in (DEPLOY / "env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    check_settings("orchestrator", steadyrl_env(example, "orchestrator"))
    # π's replica: the rollout replicas' settings, in the policy_eval pool, unquantised, scraped; env.example's two
    # commented lines turn on its profile and the orchestrator's switch together
    services = doc["services"]
    assert services["inference-policy"]["environment"] == {
        **services["inference"]["environment"], "STEADYRL_INFERENCE_REPLICA_ID": "replica-policy",
        "STEADYRL_INFERENCE_POOL": "policy_eval", "STEADYRL_INFERENCE_QUANTIZATION": "none"}
    assert services["inference-policy"]["depends_on"] == services["inference"]["depends_on"]
    commented = dict(line[2:].split("=", 1) for line in (DEPLOY / "env.example").read_text().splitlines()
                     if re.match(r"# (COMPOSE_PROFILES|STEADYRL_ORCHESTRATOR_POLICY_EVAL)=", line))
    assert commented["COMPOSE_PROFILES"] in services["inference-policy"]["profiles"]
    check_settings("orchestrator", steadyrl_env(commented, "orchestrator"))
    assert steadyrl_env(commented, "orchestrator") == {"STEADYRL_ORCHESTRATOR_POLICY_EVAL": "true"}
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    replicas = next(job for job in scrape if job["job_name"] == "steadyrl-inference")
    assert replicas["dns_sd_configs"][0]["names"] == ["inference"]  # π's replica answers to it too (an alias):
    assert services["inference-policy"]["networks"] == {"default": {"aliases": ["inference"]}}  # no failed lookup
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()
    with pytest.raises(ValueError, match="learning_rat"):  # a typo in an env name fails
        check_settings("trainer", {"STEADYRL_TRAINER_LEARNING_RAT": "1"})


# --- kubernetes ----------------------------------------------------------------------------------

def render(overlay: str, deploy: Path = DEPLOY) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the kustomizations"
    out = subprocess.run([kubectl, "kustomize", str(deploy / "k8s" / "overlays" / overlay)], capture_output=True,
                         text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_with_policy_eval(overlay: str, tmp_path: Path) -> list[dict]:
    """The overlay with components/policy-eval added, as its comment tells a user to: in a copy of deploy/."""
    deploy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, deploy, ignore=shutil.ignore_patterns("node_modules"))
    with open(deploy / "k8s" / "overlays" / overlay / "kustomization.yaml", "a") as f:
        f.write("components:\n  - ../../components/policy-eval\n")
    return render(overlay, deploy)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kustomize_renders_and_validates_against_the_kubernetes_schemas(overlay):
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    docs = render(overlay)
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == sorted(["ConfigMap", "Deployment", "ScaledObject", "PodMonitor", "PrometheusRule", "Service",
                            "StatefulSet", *(["PersistentVolumeClaim"] if overlay == "gpu" else [])])
    for doc in docs:
        if doc["kind"] in ("PodMonitor", "PrometheusRule", "ScaledObject"):  # CRDs: checked below
            continue
        kubernetes_validate.validate(doc, version, strict=True)
    dashboard = next(d for d in docs if d["kind"] == "ConfigMap")  # Grafana's sidecar loads it
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["steadyrl.json"]) == json.loads(
        (DEPLOY / "grafana" / "dashboards" / "steadyrl.json").read_text())
    for kind in ("PodMonitor", "PrometheusRule"):  # what kube-prometheus-stack selects by default
        assert next(d for d in docs if d["kind"] == kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        container = doc["spec"]["template"]["spec"]["containers"][0]
        module = container.get("args", [""])[0]
        if module in SERVICE_OF:
            kind = SERVICE_OF[module]
            env = {e["name"]: e.get("value", "secret") for e in container["env"]}
            check_settings(kind, steadyrl_env(env, kind))
            assert "grpc" in container["livenessProbe"]  # native gRPC health probes
            assert container["resources"]["requests"]
        assert doc["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    orchestrator = next(d for d in docs if d["metadata"]["name"] == "orchestrator" and d["kind"] != "Service")
    assert {"name": "STEADYRL_ORCHESTRATOR_AUTOSTART", "value": "true"} in \
        orchestrator["spec"]["template"]["spec"]["containers"][0]["env"]  # the run starts by itself
    inference = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "inference")
    scaler = next(d for d in docs if d["kind"] == "ScaledObject")  # autoscaling on work, owning the count
    assert scaler["apiVersion"] == "keda.sh/v1alpha1" and scaler["spec"]["scaleTargetRef"] == {"name": "inference"}
    trigger = scaler["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and "steadyrl_orchestrator_queue_depth" in trigger["metadata"]["query"]
    assert int(trigger["metadata"]["threshold"]) >= 1 and "replicas" not in inference["spec"]
    container = inference["spec"]["template"]["spec"]["containers"][0]
    engine = {e["name"]: e.get("value") for e in container["env"]}["STEADYRL_INFERENCE_ENGINE"]
    if overlay == "gpu":
        check_gpu_overlay(docs)
        assert engine == "vllm"
    else:
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {}) and engine == "torch"


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_policy_eval_component_adds_pi_s_replica_built_from_the_inference_deployment(overlay, tmp_path):
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    plain = render(overlay)
    docs = render_with_policy_eval(overlay, tmp_path)
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    # what it adds: one Deployment, and the orchestrator's switch; nothing else changes
    assert sorted(named) == sorted([*((d["kind"], d["metadata"]["name"]) for d in plain),
                                    ("Deployment", "inference-policy")])
    policy, inference = named["Deployment", "inference-policy"], named["Deployment", "inference"]
    kubernetes_validate.validate(policy, version, strict=True)
    env = {e["name"]: e.get("value", "secret") for e in policy["spec"]["template"]["spec"]["containers"][0]["env"]}
    check_settings("inference", steadyrl_env(env, "inference"))
    assert env["STEADYRL_INFERENCE_POOL"] == "policy_eval" and env["STEADYRL_INFERENCE_QUANTIZATION"] == "none"
    # the inference Deployment as the overlay made it (on GPUs: engine, GPUs, model PVC, probes), but for the
    # pool, one fixed replica, and labels of its own: the rollout replicas' Service and KEDA scaler do not
    # select it, the PodMonitor does
    expected = json.loads(json.dumps(inference))
    expected["metadata"] = {"name": "inference-policy", "labels": {**inference["metadata"].get("labels", {}),
                                                                  "app": "inference-policy"}}
    expected["spec"]["replicas"] = 1
    expected["spec"]["selector"]["matchLabels"]["app"] = "inference-policy"
    expected["spec"]["template"]["metadata"]["labels"]["app"] = "inference-policy"
    container = expected["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "STEADYRL_INFERENCE_POOL", "value": "policy_eval"},
                        {"name": "STEADYRL_INFERENCE_QUANTIZATION", "value": "none"}, *container["env"]]
    in_order = json.loads(json.dumps(policy))  # the overlay's env entries come first: compare env unordered
    for doc in (in_order, expected):
        doc["spec"]["template"]["spec"]["containers"][0]["env"].sort(key=lambda e: e["name"])
    assert in_order == expected
    assert policy["spec"]["template"]["metadata"]["labels"]["steadyrl.io/metrics"] == "true"
    assert named["Service", "inference"]["spec"]["selector"] == {"app": "inference"}
    assert named["ScaledObject", "inference"]["spec"]["scaleTargetRef"] == {"name": "inference"}
    orchestrator = named["Deployment", "orchestrator"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "STEADYRL_ORCHESTRATOR_POLICY_EVAL", "value": "true"} in orchestrator
    assert not any(e["name"] == "STEADYRL_ORCHESTRATOR_POLICY_EVAL"
                   for d in plain if d["kind"] == "Deployment" and d["metadata"]["name"] == "orchestrator"
                   for e in d["spec"]["template"]["spec"]["containers"][0]["env"])
    if overlay == "gpu":
        limits = policy["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 2 and env["STEADYRL_INFERENCE_ENGINE"] == "vllm"


def validate_crds(docs: list[dict]) -> list[dict]:
    """Each custom resource checked against its CRD's OpenAPI schema (deploy/schemas/validate.mjs)."""
    installed = subprocess.run([str(ROOT / "scripts" / "crd-schemas")], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-2000:]
    done = subprocess.run(["node", "validate.mjs"], input=json.dumps(docs), capture_output=True, text=True,
                          cwd=installed.stdout.strip(), check=True)
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_custom_resources_validate_against_their_crd_schemas(overlay):
    crds = [d for d in render(overlay) if d["kind"] in ("PodMonitor", "PrometheusRule", "ScaledObject")]
    results = validate_crds(crds)
    assert sorted(r["kind"] for r in results) == ["PodMonitor", "PrometheusRule", "ScaledObject"]
    assert all(r["errors"] == [] for r in results), results
    broken = json.loads(json.dumps(crds))  # the schemas do bite: one mistake in each
    for doc in broken:
        if doc["kind"] == "ScaledObject":
            doc["spec"]["minReplicaCount"] = "two"
        elif doc["kind"] == "PodMonitor":
            doc["spec"]["podMetricsEndpoints"][0]["interval"] = "every 15 s"
        else:
            del doc["spec"]["groups"][0]["rules"][0]["expr"]
    errors = {r["kind"]: r["errors"] for r in validate_crds(broken)}
    assert errors["ScaledObject"] == ["data/spec/minReplicaCount must be integer"]
    assert errors["PodMonitor"][0].startswith("data/spec/podMetricsEndpoints/0/interval must match pattern")
    assert errors["PrometheusRule"] == ["data/spec/groups/0/rules/0 must have required property expr"]


def check_gpu_overlay(docs: list[dict]) -> None:
    """What a real GPU run needs of the pods: the shape of configs/gpu-qwen3-moe-math.toml."""
    import tomllib

    recipe = tomllib.loads((ROOT / "configs" / "gpu-qwen3-moe-math.toml").read_text())
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    for name, gpus in (("inference", recipe["inference"]["gpus_per_replica"]), ("trainer", recipe["trainer"]["gpus"])):
        pod = pods[name]
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus, name
        probe = container["startupProbe"]  # a large model's load is not killed by the liveness probe
        assert "grpc" in probe and probe["failureThreshold"] * probe["periodSeconds"] >= 900, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and {"name": "dshm", "mountPath": "/dev/shm"} in \
            container["volumeMounts"], name
        assert volumes["models"] == {"name": "models", "persistentVolumeClaim": {"claimName": "steadyrl-models",
                                                                                 "readOnly": True}}, name
        assert pod["runtimeClassName"] == "nvidia" and "initContainers" not in pod, name
        if name == "inference":
            assert env["STEADYRL_INFERENCE_GPUS_PER_REPLICA"] == str(gpus) and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
        else:
            assert container["args"][:3] == ["torch.distributed.run", "--nproc_per_node", str(gpus)]
            assert env["STEADYRL_TRAINER_GPUS"] == str(gpus) and env["STEADYRL_TRAINER_PARALLEL"] == "fsdp"
    assert "initContainers" not in pods["orchestrator"]
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]


# --- prometheus and grafana ----------------------------------------------------------------------

def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: scripts/install installs Debian's prometheus package as root"
    return found


def test_promtool_accepts_the_config_and_the_rules(tmp_path):
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text().replace("/etc/prometheus/alerts.yml",
                                                                             str(tmp_path / "alerts.yml"))
    (tmp_path / "prometheus.yml").write_text(config)
    for args in (["check", "config", str(tmp_path / "prometheus.yml")],
                 ["check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")]):
        done = subprocess.run([promtool(), *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr



def test_every_alert_fires_on_a_failure_and_stays_quiet_on_a_healthy_run():
    done = subprocess.run([promtool(), "test", "rules", "alerts_test.yml"], capture_output=True, text=True,
                          cwd=DEPLOY / "prometheus")
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert fired == alerts and quiet == alerts  # each alert: a series it fires on and a healthy one
    assert {"SteadyrlServiceDown", "SteadyrlNoLiveReplica", "SteadyrlTrainerStalled", "SteadyrlRolloutsStarved",
            "SteadyrlDeadLetters", "SteadyrlWeightSyncFailures", "SteadyrlCollapseEarlyWarning"} <= alerts


def test_the_inference_scaler_counts_the_rollout_pool_s_work_alone(tmp_path):
    """KEDA's query, evaluated by promtool on one value per state the orchestrator exports: it
    sums the rollouts pool's pending and leased tasks (3 + 5), not π's (`pending_policy`,
    `leased_policy`), completed ones or the rollout stream."""
    scaler = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "base" / "inference" / "inference.yaml").read_text())
                  if d["kind"] == "ScaledObject")
    states = {"pending": 3, "leased": 5, "pending_policy": 7, "leased_policy": 11, "completed": 100, "dead": 13,
              "rollouts": 17}
    assert {f.name for f in dataclasses.fields(QueueDepths)} == set(states)  # the orchestrator exports each field
    series = [{"series": f'steadyrl_orchestrator_queue_depth{{state="{k}", job="steadyrl"}}', "values": f"{v}x5"}
              for k, v in states.items()]
    case = {"rule_files": [], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series,
                       "promql_expr_test": [{"expr": scaler["spec"]["triggers"][0]["metadata"]["query"],
                                             "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": 8}]}]}]}
    (tmp_path / "scaler_test.yml").write_text(yaml.safe_dump(case))
    done = subprocess.run([promtool(), "test", "rules", "scaler_test.yml"], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def exported_metric_names() -> set[str]:
    """Every sample name the services register (counters as _total, histograms as _bucket...)."""
    import importlib

    from prometheus_client import REGISTRY

    for module in ("services.weightsync.server", "services.inference.worker", "services.inference.server",
                   "services.trainer.trainer", "services.orchestrator.orchestrator", "services.orchestrator.server"):
        importlib.import_module(module)
    names = set()
    for metric in REGISTRY.collect():
        names.add(metric.name)
        for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
            names.add(metric.name + suffix)
    return {n for n in names if n.startswith("steadyrl_")}


def test_dashboard_and_alerts_name_only_exported_metrics():
    exported = exported_metric_names()
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "steadyrl.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {"${datasource}"}  # any Prometheus, no fixed uid
    assert dashboard["templating"]["list"][0] == {"name": "datasource", "label": "Prometheus", "type": "datasource",
                                                  "query": "prometheus", "current": {}, "hide": 0, "refresh": 1}
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    named = {m for e in exprs for m in re.findall(r"steadyrl_[a-z0-9_]+", e)}
    assert named and not (named - exported), sorted(named - exported)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("reward", "entropy", "mismatch kl", "is weights", "clip", "staleness", "routing agreement",
                  "first-order", "tokens/s", "queue", "weight-sync", "version"):
        assert topic in titles, topic
    used = " ".join(exprs)
    for name in ("mismatch_kl_k3", "entropy", "staleness_max"):  # the collapse and budget alerts
        assert name in used


def test_a_real_prometheus_scrapes_a_running_service(tmp_path):
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus is missing: scripts/install installs Debian's package as root"
    grpc_port, metrics_port, web_port = free_port(), free_port(), free_port()
    env = {**os.environ, "STEADYRL_WEIGHTSYNC_PORT": str(grpc_port), "STEADYRL_WEIGHTSYNC_METRICS_PORT": str(metrics_port),
           "STEADYRL_WEIGHTSYNC_SPILL_DIR": str(tmp_path / "spill")}
    service = subprocess.Popen([sys.executable, "-m", "services.weightsync"], env=env)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "steadyrl-weightsync",
                            "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}]}))
    server = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web_port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx

        result = []
        for _ in range(120):
            time.sleep(0.5)
            try:
                reply = httpx.get(f"http://127.0.0.1:{web_port}/api/v1/query",
                                  params={"query": "steadyrl_weightsync_versions_held"}, timeout=2).json()
            except httpx.HTTPError:
                continue
            result = reply.get("data", {}).get("result", [])
            if result:
                break
        assert result and result[0]["metric"]["job"] == "steadyrl-weightsync"
        assert float(result[0]["value"][1]) == 0.0  # nothing pushed yet
    finally:
        for process in (server, service):
            process.send_signal(signal.SIGTERM)
            process.wait(20)


def test_replay_alerts_fires_on_a_collapsing_series_and_not_on_a_healthy_one():
    """`steadyrl replay-alerts`: a run's metrics, one step per minute, through promtool. The mismatch
    KL doubling from step 42 while entropy falls fires the early warning once it has held 5 steps
    (the series of the collapse case in alerts_test.yml); staleness 3 over a budget of 1 fires after
    10 steps; a reward falling from 0.4 to 0.1 at step 61 fires the reward collapse at step 91 (past
    an hour: promtool then prints "1h30m"); the eval round of step 75, 25 points under the best, fires
    the eval drop from there; π's round of step 25, 15 points under its first (step 0), is a dip (the
    next is back above), and π under its start fires from its round of step 80, the second in a row
    more than 10 points under; flat series never do."""
    from steadyrl.alert_replay import firing_steps, minutes, replayed_alerts

    rules = DEPLOY / "prometheus" / "alerts.yml"
    assert replayed_alerts(rules) == ["SteadyrlCollapseEarlyWarning", "SteadyrlRewardCollapse", "SteadyrlEvalDrop",
                                      "SteadyrlPolicyUnderStart", "SteadyrlStalenessOverBudget"]
    assert (minutes("45m"), minutes("1h30m"), minutes("1d2h"), minutes("0s")) == (45, 90, 1560, 0)
    kl = [0.005] * 41 + [0.01 * 2**i for i in range(9)] + [2.56] * 50
    collapsing = [{"step": i + 1, "mismatch_kl_k3": k, "entropy": 0.5 - 0.002 * min(i, 49),
                   "staleness_max": 3 * (30 <= i < 50), "reward_mean": 0.4 if i < 60 else 0.1, "recipe": "minirl"}
                  for i, k in enumerate(kl)]
    budget = {"steadyrl_trainer_max_staleness": 1}
    evals = [{"step": 0, "accuracy": 0.4}, {"step": 50, "accuracy": 0.45, "sets": {"main": {"accuracy": 0.45}}},
             {"step": 75, "accuracy": 0.2}]
    policy = [{"step": 0, "accuracy": 0.5}, {"step": 25, "accuracy": 0.35}, {"step": 40, "accuracy": 0.55},
              {"step": 60, "accuracy": 0.38}, {"step": 80, "accuracy": 0.35}]
    fired = firing_steps(collapsing, rules, budget, evals, policy)
    # the early warning ends once entropy has stopped falling (its 10 min delta, flat from step 50)
    assert fired == {"SteadyrlCollapseEarlyWarning": list(range(49, 55)), "SteadyrlRewardCollapse": list(range(91, 101)),
                     "SteadyrlEvalDrop": list(range(75, 101)), "SteadyrlPolicyUnderStart": list(range(80, 101)),
                     "SteadyrlStalenessOverBudget": list(range(41, 51))}
    healthy = [{**row, "mismatch_kl_k3": 0.005, "staleness_max": 1, "reward_mean": 0.4} for row in collapsing]
    steady = [{"step": e["step"], "accuracy": 0.4} for e in evals]
    assert firing_steps(healthy, rules, budget, steady, steady) == {a: [] for a in fired}


def test_the_alerts_on_a_collapsed_grid_run():
    """A real run of paper-grid-fp4.toml's N = 1 w/o IS at lr 4e-3 (seed 0, 300 steps; the series the
    rules read, docs/reproduction/fp4-live-pi/collapsed-run): π 0.32 → 0.215 at version 25 → 0.01.
    π's alert fires from its second round in a row under the start (version 50), with μ's eval drop,
    the reward collapse 28 steps later; the paper's early warning (KL spike with entropy falling) never."""
    from steadyrl.alert_replay import replay_run

    fired = replay_run(ROOT / "docs" / "reproduction" / "fp4-live-pi" / "collapsed-run",
                       DEPLOY / "prometheus" / "alerts.yml")["firing_steps"]
    assert fired["SteadyrlPolicyUnderStart"] == list(range(50, 301))
    assert fired["SteadyrlEvalDrop"][0] == 50 and fired["SteadyrlRewardCollapse"][0] == 78
    assert fired["SteadyrlCollapseEarlyWarning"] == [] and fired["SteadyrlStalenessOverBudget"] == []


def test_replay_alerts_says_when_promtool_cannot_run_the_rules(tmp_path):
    from steadyrl.alert_replay import firing_steps

    rules = tmp_path / "rules.yml"
    rules.write_text('groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: steadyrl_trainer_last_metric{name="x"} >\n')
    with pytest.raises(RuntimeError, match="promtool failed"):
        firing_steps([{"step": 1, "x": 1.0}], rules)
