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

from shared.runstore.queues import QueueDepths
from shared.runstore.redis_server import free_port
from steadyrl.service_settings import validate

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def service_of(args: list[str]) -> str | None:
    """The service a container's command runs: `steadyrl.cli serve NAME`, or the trainer's
    `steadyrl.cli trainer-node` (torchrun over the recipe's GPUs); None for anything else."""
    if args[:2] == ["steadyrl.cli", "serve"]:
        return args[2]
    return "trainer" if args[:2] == ["steadyrl.cli", "trainer-node"] else None


def steadyrl_env(env: dict[str, str], service: str) -> dict[str, str]:
    prefix = f"STEADYRL_{service.upper()}_"
    return {k: re.sub(r"\$\{?\(?REDIS_PASSWORD\)?\}?", "pw", str(v)) for k, v in env.items() if k.startswith(prefix)}


def check_settings(service: str, env: dict[str, str]) -> None:
    # model_path is required by three services; a probe value stands in where a manifest mounts it
    validate(
        service, {f"STEADYRL_{service.upper()}_MODEL_PATH": "/models/tiny", **env} if service != "weightsync" else env
    )


def dry_run_settings(recipe: str, gpus: int, overrides: tuple[str, ...] = ()) -> dict[str, dict]:
    """Each service's settings as `steadyrl run --dry-run --gpus N RECIPE [--set ...]` prints them
    (a pool's replica's as `pool/NAME`)."""
    done = subprocess.run(
        [sys.executable, "-m", "steadyrl.cli", "run", str(ROOT / "configs" / recipe), "--dry-run", "--gpus", str(gpus)]
        + [a for o in overrides for a in ("--set", o)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout)
    return {**printed["settings"], **{f"pool/{name}": s for name, s in printed["pools"].items()}}


def recipe_driven(
    service: str, env: dict[str, str], recipes: Path, printed: dict[str, dict], printed_as: str = ""
) -> dict:
    """The settings `service` resolves from a deployment's environment (STEADYRL_RECIPE at
    /etc/steadyrl/NAME read from `recipes`), checked equal to what `--dry-run` printed (under
    `printed_as`: a pool's replica, `pool/NAME`) but for the fields a deployment places
    (steadyrl/service_settings.py DEPLOYMENT_FIELDS); returns them."""
    from steadyrl.service_settings import DEPLOYMENT_FIELDS, deployed_settings

    name = env["STEADYRL_RECIPE"].removeprefix("/etc/steadyrl/")
    assert env["STEADYRL_RECIPE"] == f"/etc/steadyrl/{name}", env["STEADYRL_RECIPE"]
    resolved = deployed_settings(service, {**env, "STEADYRL_RECIPE": str(recipes / name)}).model_dump(mode="json")
    settings, expected = dotted(resolved), dotted(printed[printed_as or service])
    differ = sorted(k for k in expected if k not in DEPLOYMENT_FIELDS and settings[k] != expected[k])
    assert not differ, (service, {k: (settings[k], expected[k]) for k in differ})
    prefix = f"STEADYRL_{service.upper()}_"
    placed = {k[len(prefix) :].lower().replace("__", ".") for k in env if k.startswith(prefix)}
    assert placed <= DEPLOYMENT_FIELDS, (service, sorted(placed - DEPLOYMENT_FIELDS))  # nothing the recipe decides
    return resolved


def dotted(values: dict, prefix: str = "") -> dict:
    """Nested settings as one level of dotted names (a section's fields compared one by one)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


# --- docker compose ------------------------------------------------------------------------------

POOL_SERVICES = {"inference-teacher": "teacher", "inference-judge": "judge"}


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} and ${VAR} with nothing set (the defaults)."""
    return re.sub(r"\$\{[A-Z0-9_]+(?::-([^}]*))?\}", lambda m: m.group(1) or "", value)


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # resolves the x-steadyrl merge keys


def test_compose_follows_the_specification():
    from compose_spec import PyCompose

    spec = PyCompose.from_json(interpolate(json.dumps(compose()))).to_dict()  # as compose reads it: ${VAR:-default}
    assert set(spec["services"]) == {
        "redis",
        "model-init",
        "weightsync",
        "trainer",
        "inference",
        "inference-policy",
        "inference-teacher",
        "inference-judge",
        "orchestrator",
        "prometheus",
        "alertmanager",
        "grafana",
    }
    assert spec["services"]["inference-policy"]["profiles"] == ["policy-eval"]  # off unless asked for
    assert spec["services"]["inference-judge"]["profiles"] == ["judge"]  # a recipe's pool: on with its profile
    assert spec["services"]["inference-teacher"]["profiles"] == ["teacher"]
    with pytest.raises(ValueError, match="imagee"):  # the validator does reject what the spec does not allow
        PyCompose.from_json(json.dumps({"services": {"a": {"image": "x", "imagee": "y"}}}))


def test_no_restarting_service_depends_on_the_model_job_and_each_waits_for_its_model():
    """podman-compose makes every dependency, transitive ones too, a `--requires`, and podman restarts
    no container whose required container has exited: a service depending on the one-shot model-init
    would stay down after a crash. Each service that reads /models/tiny waits for it instead, bounded."""
    services = compose()["services"]

    def needs(name: str) -> set[str]:
        direct = set(services[name].get("depends_on", {}))
        return direct.union(*(needs(d) for d in direct)) if direct else set()

    jobs = {name for name, s in services.items() if s.get("restart") == "no"}
    assert jobs == {"model-init"}
    for name, service in services.items():
        if service.get("restart") not in (None, "no"):
            assert not needs(name) & jobs, name
        if "serve" in service.get("command", []) and name != "weightsync":
            command = service["command"]
            assert float(command[command.index("--model-wait") + 1]) >= 120, name


def test_compose_starts_a_recipe_s_pools_and_points_the_replicas_at_them():
    """A recipe with [judge] and [teacher]: each pool's service resolves to the replica `steadyrl run`
    starts for it (the pool's model, engine and dtype, no weight sync), the rollout replicas reach each at
    its service's name, and a pool's service under a recipe without the pool refuses to start."""
    from steadyrl.service_settings import deployed_settings

    doc = compose()
    overrides = ('teacher.path="/models/teacher"', "trainer.distill.coef=1.0")
    printed = dry_run_settings("tiny-judge.toml", 0, overrides)
    recipe = {"STEADYRL_RECIPE": "/etc/steadyrl/tiny-judge.toml", "STEADYRL_RECIPE_SET": ";".join(overrides)}
    for name, pool in POOL_SERVICES.items():
        service = doc["services"][name]
        env = {k: interpolate(str(v)) for k, v in service["environment"].items()} | recipe
        settings = recipe_driven("inference", env, ROOT / "configs", printed, f"pool/{pool}")
        assert (
            settings["pool"] == pool
            and settings["model_path"] == {"judge": "tiny-judge", "teacher": "/models/teacher"}[pool]
        )
        assert (settings["weightsync_address"], settings["orchestrator_address"]) == ("", "")  # fixed weights
        assert settings["dtype"] == "float32" and settings["judge"]["templates"] == {}  # nothing of [inference]
        assert set(service["secrets"]) == {"token", "redis_password"}
        # a kit model of its own built once, in the cache on the models volume model-init's build shares
        cache = service["environment"]["STEADYRL_CACHE"]
        assert cache == doc["services"]["model-init"]["environment"]["STEADYRL_CACHE"] and cache.startswith("/models/")
        if pool == "judge":
            refused = {**env, "STEADYRL_RECIPE": str(ROOT / "configs" / "tiny-arith.toml"), "STEADYRL_RECIPE_SET": ""}
            with pytest.raises(ValueError, match=r"the recipe has no \[judge\]: a judge pool's replica has nothing"):
                deployed_settings("inference", refused)
    env = {k: interpolate(str(v)) for k, v in doc["services"]["inference"]["environment"].items()} | recipe
    replica = recipe_driven("inference", env, ROOT / "configs", printed)
    assert replica["judge"]["addresses"] == ["inference-judge:50052"]
    assert replica["teacher"]["addresses"] == ["inference-teacher:50052"]
    assert replica["judge"]["templates"]["arith"]["compare_with"] == "exact_match"


def test_compose_resolves_the_recipe_as_steadyrl_run_does_and_keeps_secrets_in_files():
    doc = compose()
    printed = dry_run_settings("tiny-arith.toml", 0)
    checked = 0
    for name, service in doc["services"].items():
        kind = service_of(service.get("command") or [])
        if kind is None or name in POOL_SERVICES:  # a pool's replica needs a recipe with the pool: below
            continue
        env = {k: interpolate(str(v)) for k, v in service["environment"].items()}
        settings = recipe_driven(kind, env, ROOT / "configs", printed)
        assert "./configs:/etc/steadyrl:ro" in service["volumes"], name
        check_settings(kind, steadyrl_env(env, kind))  # a misspelt placement variable fails
        checked += 1
        assert "env_file" not in service and "STEADYRL_HEALTH_PORT" in env  # nothing from .env but what is named
        assert env["STEADYRL_TOKEN_FILE"] == "/run/secrets/token" and "token" in service["secrets"]
        assert not any("PASSWORD" in v or "TOKEN}" in v for v in env.values())  # secrets only as files
        if kind != "weightsync":
            assert env[f"STEADYRL_{kind.upper()}_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"
            assert settings["redis_url"] == "**********" and "redis_password" in service["secrets"]
        if kind == "trainer":  # weights are signed in every deploy, by the trainer alone
            assert env["STEADYRL_TRAINER_PUBLISH__SIGNING_KEY_FILE"] == "/run/secrets/weights_signing_key"
            assert "weights_signing_key" in service["secrets"] and "weights_verify_key" not in service["secrets"]
        else:  # and checked by weight-sync and every replica, which never hold the signing key
            assert "weights_signing_key" not in service["secrets"]
            if kind in ("weightsync", "inference"):
                assert env[f"STEADYRL_{kind.upper()}_VERIFY_KEY_FILE"] == "/run/secrets/weights_verify_key"
                assert "weights_verify_key" in service["secrets"]
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"]
    assert checked == 5
    assert set(doc["secrets"]) == {
        "token",
        "redis_password",
        "weights_signing_key",
        "weights_verify_key",
        "grafana_admin_password",
    }
    assert doc["services"]["grafana"]["secrets"] == ["grafana_admin_password"]  # Grafana gets its own secret alone
    assert "env_file" not in doc["services"]["grafana"]
    assert "ports" not in doc["services"]["inference"]  # `--scale inference=N` needs no fixed host port
    assert (
        doc["services"]["orchestrator"]["environment"]["STEADYRL_ORCHESTRATOR_AUTOSTART"] == "true"
    )  # no manual start
    redis = " ".join(doc["services"]["redis"]["command"])
    assert "--appendonly yes" in redis and "--maxmemory-policy noeviction" in redis and "--maxmemory 1gb" in redis
    assert "--requirepass" not in redis and "/run/secrets/redis_password" in redis  # never on a command line
    example = dict(
        line.split("=", 1)
        for line in (DEPLOY / "env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert {s["environment"] for s in doc["secrets"].values()} <= set(example)  # env.example names each secret
    # π's replica: the rollout replicas' settings, in the policy_eval pool, unquantised, scraped; env.example's two
    # commented lines turn on its profile and the orchestrator's switch together
    services = doc["services"]
    assert services["inference-policy"]["environment"] == {
        **services["inference"]["environment"],
        "STEADYRL_INFERENCE_REPLICA_ID": "replica-policy",
        "STEADYRL_INFERENCE_POOL": "policy_eval",
        "STEADYRL_INFERENCE_QUANTIZATION": "none",
    }
    assert services["inference-policy"]["depends_on"] == services["inference"]["depends_on"]
    commented = [
        line[2:].split("=", 1)[1]
        for line in (DEPLOY / "env.example").read_text().splitlines()
        if re.match(r"# COMPOSE_PROFILES=", line)
    ]
    assert commented == ["policy-eval", "judge"]  # the profiles of π's replica and of a judge pool
    assert commented[0] in services["inference-policy"]["profiles"]
    assert commented[1] in services["inference-judge"]["profiles"]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    replicas = next(job for job in scrape["scrape_configs"] if job["job_name"] == "steadyrl-inference")
    assert replicas["dns_sd_configs"][0]["names"] == ["inference"]  # π's replica answers to it too (an alias):
    assert replicas["dns_sd_configs"][0]["refresh_interval"] == "5s"  # a replica started late is scraped soon
    assert services["inference-policy"]["networks"] == {"default": {"aliases": ["inference"]}}  # no failed lookup
    assert scrape["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    from steadyrl.recipe import load_recipe

    assert doc["x-recipe"] == "/etc/steadyrl/tiny-arith.toml"  # `up` carries the recipe's run id, as the samples do
    run_id = load_recipe(ROOT / "configs" / "tiny-arith.toml").run_id
    assert all(
        job["honor_labels"] and job["relabel_configs"] == [{"target_label": "run", "replacement": run_id}]
        for job in scrape["scrape_configs"]
    )
    assert "./deploy/alertmanager:/etc/alertmanager:ro" in services["alertmanager"]["volumes"]
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()
    with pytest.raises(ValueError, match="learning_rat"):  # a typo in an env name fails
        check_settings("trainer", {"STEADYRL_TRAINER_LEARNING_RAT": "1"})


# --- kubernetes ----------------------------------------------------------------------------------


def render(overlay: str, deploy: Path = DEPLOY) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the kustomizations"
    out = subprocess.run(
        [kubectl, "kustomize", str(deploy / "k8s" / "overlays" / overlay)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_with_policy_eval(overlay: str, tmp_path: Path) -> list[dict]:
    """The overlay with components/policy-eval added, as its comment tells a user to: in a copy of deploy/."""
    deploy = copy_deploy(tmp_path)
    with open(deploy / "k8s" / "overlays" / overlay / "kustomization.yaml", "a") as f:
        f.write("components:\n  - ../../components/policy-eval\n")
    return render(overlay, deploy)


def copy_deploy(tmp_path: Path) -> Path:
    """deploy/ and configs/ (the recipes ConfigMap's files) copied side by side, to edit and render."""
    shutil.copytree(DEPLOY, tmp_path / "deploy", ignore=shutil.ignore_patterns("node_modules"))
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    return tmp_path / "deploy"


def container_env(container: dict, docs: list[dict]) -> dict[str, str]:
    """A container's environment as the kubelet gives it: ConfigMap keys looked up in the rendered
    ConfigMaps, a pod field as a stand-in name, a Secret key as "secret"."""
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env = {}
    for e in container.get("env", []):
        source = e.get("valueFrom", {})
        if "configMapKeyRef" in source:
            env[e["name"]] = maps[source["configMapKeyRef"]["name"]][source["configMapKeyRef"]["key"]]
        elif "fieldRef" in source:
            env[e["name"]] = "pod-0"
        else:
            env[e["name"]] = e.get("value", "secret")
    return env


def recipes_of(docs: list[dict], tmp_path: Path) -> Path:
    """The files of the rendered ConfigMap steadyrl-recipes, written out (what a pod mounts at
    /etc/steadyrl): the run recipes of configs/, each equal to its file."""
    recipes = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "steadyrl-recipes")["data"]
    runnable = {p.name for p in (ROOT / "configs").glob("*.toml") if "[grid]" not in p.read_text()}
    assert set(recipes) == runnable  # every run recipe, no experiment grid
    folder = tmp_path / "etc-steadyrl"
    folder.mkdir(exist_ok=True)
    for name, text in recipes.items():
        assert text == (ROOT / "configs" / name).read_text(), name
        (folder / name).write_text(text)
    return folder


RECIPES = {"cpu": ("tiny-arith.toml", "tiny-arith", 0), "gpu": ("gpu-qwen3-moe-math.toml", "qwen3-moe-math", 12)}


def workloads(docs: list[dict]) -> dict[str, dict]:
    """Deployments and StatefulSets by name."""
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kustomize_renders_and_validates_against_the_kubernetes_schemas(overlay):
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    docs = render(overlay)
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "ScaledObject",
            "PodMonitor",
            "PrometheusRule",
            "AlertmanagerConfig",
            "Service",
            "StatefulSet",
            "NetworkPolicy",
            "PodDisruptionBudget",
            *(["PersistentVolumeClaim", "Job"] if overlay == "gpu" else []),
        ]
    )
    for doc in docs:
        if doc["kind"] in ("PodMonitor", "PrometheusRule", "ScaledObject", "AlertmanagerConfig"):  # CRDs: below
            continue
        kubernetes_validate.validate(doc, version, strict=True)
    assert {d["metadata"].get("namespace") for d in docs} == {"steadyrl"}
    dashboard = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "steadyrl-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"  # Grafana's sidecar loads it
    assert json.loads(dashboard["data"]["steadyrl.json"]) == json.loads(
        (DEPLOY / "grafana" / "dashboards" / "steadyrl.json").read_text()
    )
    for kind in ("PodMonitor", "PrometheusRule", "AlertmanagerConfig"):  # what kube-prometheus-stack selects by default
        assert next(d for d in docs if d["kind"] == kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    routes = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    inhibits = next(d for d in docs if d["kind"] == "AlertmanagerConfig")["spec"]["inhibitRules"]
    as_text = [
        (
            [f'{m["name"]}{m.get("matchType", "=")}"{m["value"]}"' for m in r["sourceMatch"]],
            [f'{m["name"]}{m.get("matchType", "=")}"{m["value"]}"' for m in r["targetMatch"]],
        )
        for r in inhibits
    ]
    assert as_text == [(r["source_matchers"], r["target_matchers"]) for r in routes["inhibit_rules"]]
    for doc in docs:  # hardened: every pod and container
        if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False, doc["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"] + pod.get("initContainers", []):
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, container["name"]
            assert "resources" in container and container["resources"]["limits"]["memory"]
            env = {e["name"]: e for e in container.get("env", [])}
            assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in env.values())  # secrets: files only
            assert "$(" not in json.dumps(env)  # no secret spliced into a URL
        if service_of(pod["containers"][0].get("args", [])):
            container = pod["containers"][0]
            secrets = next(v for v in pod["volumes"] if v["name"] == "secrets")["secret"]
            mounted = {i["key"] for i in secrets["items"]}
            assert secrets["secretName"] == "steadyrl-secrets" and "token" in mounted
            name = doc["metadata"]["name"].removesuffix("-policy")
            assert "redis-password" in mounted  # every service reads the run's Redis (weight-sync: its instance)
            assert ("weights-signing-key" in mounted) == (name == "trainer")  # the trainer's alone
            assert ("weights-verify-key" in mounted) == (name in ("weightsync", "inference"))
            assert "grpc" in container["livenessProbe"]  # native gRPC health probes
            assert container["resources"]["requests"]
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    budgets = {name: d["spec"] for (kind, name), d in named.items() if kind == "PodDisruptionBudget"}
    assert budgets["inference"] == {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "inference"}}}
    assert all(budgets[n]["maxUnavailable"] == 0 for n in ("trainer", "redis", "weightsync", "orchestrator"))
    policies = {name: d["spec"] for (kind, name), d in named.items() if kind == "NetworkPolicy"}
    assert policies["default-deny"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    redis_from = policies["redis"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["values"]
    assert sorted(redis_from) == [  # weight-sync: the run's instance alone
        "inference",
        "inference-judge",
        "inference-policy",
        "inference-teacher",
        "orchestrator",
        "trainer",
        "weightsync",
    ]
    orchestrator = workloads(docs)["orchestrator"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "STEADYRL_ORCHESTRATOR_AUTOSTART", "value": "true"} in orchestrator["env"]  # starts by itself
    inference = workloads(docs)["inference"]
    scaler = next(d for d in docs if d["kind"] == "ScaledObject")  # autoscaling on work, owning the count
    assert scaler["apiVersion"] == "keda.sh/v1alpha1" and scaler["spec"]["scaleTargetRef"] == {"name": "inference"}
    trigger = scaler["spec"]["triggers"][0]
    _, run_id, _ = RECIPES[overlay]
    assert trigger["type"] == "prometheus" and int(trigger["metadata"]["threshold"]) >= 1
    assert trigger["metadata"]["query"].count(f'namespace="steadyrl", run="{run_id}"') == 2  # this run's work alone
    assert "replicas" not in inference["spec"]
    if overlay == "gpu":
        check_gpu_overlay(docs)
    else:
        assert "nvidia.com/gpu" not in inference["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_every_service_of_an_overlay_resolves_its_recipe_as_steadyrl_run_does(overlay, tmp_path):
    """The settings each pod's service builds — the recipe the ConfigMap names, from the recipes
    ConfigMap, under the pod's own variables — equal `steadyrl run --dry-run` of that recipe but
    for what a deployment places; every pod carries the run's label."""
    recipe, run_id, gpus = RECIPES[overlay]
    docs = render(overlay)
    folder = recipes_of(docs, tmp_path)
    printed = dry_run_settings(recipe, gpus)
    resolved = {}
    for name, doc in workloads(docs).items():
        container = doc["spec"]["template"]["spec"]["containers"][0]
        kind = service_of(container.get("args", []))
        assert doc["spec"]["template"]["metadata"]["labels"]["steadyrl.io/run"] == run_id, name
        if kind is None:
            continue
        env = container_env(container, docs)
        resolved[name] = recipe_driven(kind, env, folder, printed)
        assert {"name": "recipes", "mountPath": "/etc/steadyrl", "readOnly": True} in container["volumeMounts"]
    assert set(resolved) == {"weightsync", "trainer", "inference", "orchestrator"}
    if overlay == "gpu":  # the model at the recipe's path: no pod overrides it
        assert {s["model_path"] for n, s in resolved.items() if n != "weightsync"} == {"/models/Qwen3-30B-A3B"}
        assert resolved["trainer"]["parallel"]["gpus"] == 8 and resolved["inference"]["engine"] == "vllm"


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_policy_eval_component_adds_pi_s_replica_built_from_the_inference_deployment(overlay, tmp_path):
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    plain = render(overlay)
    docs = render_with_policy_eval(overlay, tmp_path)
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    # what it adds: one Deployment, and the orchestrator's switch; nothing else changes
    assert sorted(named) == sorted(
        [*((d["kind"], d["metadata"]["name"]) for d in plain), ("Deployment", "inference-policy")]
    )
    policy = named["Deployment", "inference-policy"]
    inference = named["Deployment", "inference"]
    kubernetes_validate.validate(policy, version, strict=True)
    env = {e["name"]: e.get("value", "secret") for e in policy["spec"]["template"]["spec"]["containers"][0]["env"]}
    check_settings("inference", steadyrl_env(env, "inference"))
    assert env["STEADYRL_INFERENCE_POOL"] == "policy_eval" and env["STEADYRL_INFERENCE_QUANTIZATION"] == "none"
    # the inference Deployment as the overlay made it (on GPUs: engine, GPUs, model PVC, probes), but for the
    # pool, one fixed replica, and labels of its own: the rollout replicas' Service and KEDA scaler do not
    # select it, the PodMonitor does
    expected = json.loads(json.dumps(inference))
    expected["metadata"] = {
        "name": "inference-policy",
        "namespace": "steadyrl",
        "labels": {**inference["metadata"].get("labels", {}), "app": "inference-policy"},
    }
    expected["spec"]["replicas"] = 1
    expected["spec"]["selector"]["matchLabels"]["app"] = "inference-policy"
    expected["spec"]["template"]["metadata"]["labels"]["app"] = "inference-policy"
    container = expected["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [
        {"name": "STEADYRL_INFERENCE_POOL", "value": "policy_eval"},
        {"name": "STEADYRL_INFERENCE_QUANTIZATION", "value": "none"},
        *container["env"],
    ]
    in_order = json.loads(json.dumps(policy))  # the overlay's env entries come first: compare env unordered
    for doc in (in_order, expected):
        doc["spec"]["template"]["spec"]["containers"][0]["env"].sort(key=lambda e: e["name"])
    assert in_order == expected
    assert policy["spec"]["template"]["metadata"]["labels"]["steadyrl.io/metrics"] == "true"
    assert named["Service", "inference"]["spec"]["selector"] == {"app": "inference"}
    assert named["ScaledObject", "inference"]["spec"]["scaleTargetRef"] == {"name": "inference"}
    orchestrator = named["Deployment", "orchestrator"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "STEADYRL_ORCHESTRATOR_EVALS__POLICY", "value": "true"} in orchestrator
    assert not any(
        e["name"] == "STEADYRL_ORCHESTRATOR_EVALS__POLICY"
        for d in plain
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "orchestrator"
        for e in d["spec"]["template"]["spec"]["containers"][0]["env"]
    )
    from steadyrl.service_settings import deployed_settings

    resolved = container_env(policy["spec"]["template"]["spec"]["containers"][0], docs)
    name = resolved["STEADYRL_RECIPE"].removeprefix("/etc/steadyrl/")
    settings = deployed_settings("inference", {**resolved, "STEADYRL_RECIPE": str(ROOT / "configs" / name)})
    assert (settings.pool, settings.quantization, settings.run_id) == ("policy_eval", "none", RECIPES[overlay][1])
    if overlay == "gpu":
        limits = policy["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 2 and settings.engine == "vllm" and settings.gpus_per_replica == 2


def test_the_pool_components_start_a_recipe_s_pools_as_steadyrl_run_does(tmp_path):
    """The cpu overlay on a recipe with [judge] and [teacher], both pool components added as their
    comments say: each pool's Deployment resolves to the replica `steadyrl run` starts for it, the rollout
    replicas reach it at its headless Service, KEDA scales it on its own queue depth, only the rollout
    replicas may call it; every manifest validates against the Kubernetes schemas and the CRDs'."""
    import kubernetes_validate

    deploy = copy_deploy(tmp_path)
    recipe = deploy.parent / "configs" / "tiny-judge.toml"
    recipe.write_text(recipe.read_text() + '\n[teacher]\npath = "/models/teacher"\n\n[trainer.distill]\ncoef = 1.0\n')
    with open(deploy / "k8s" / "overlays" / "cpu" / "kustomization.yaml", "a") as f:
        f.write("components:\n  - ../../components/judge-pool\n  - ../../components/teacher-pool\n")
    base = deploy / "k8s" / "base" / "kustomization.yaml"
    base.write_text(
        base.read_text().replace("recipe=/etc/steadyrl/tiny-arith.toml", "recipe=/etc/steadyrl/tiny-judge.toml")
    )
    docs = render("cpu", deploy)
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    version = kubernetes_validate.latest_version()
    for doc in docs:
        if "keda.sh" not in doc["apiVersion"] and "monitoring.coreos.com" not in doc["apiVersion"]:
            kubernetes_validate.validate(doc, version, strict=True)
    results = validate_crds([d for d in docs if d["kind"] == "ScaledObject"])
    assert len(results) == 3 and all(r["errors"] == [] for r in results), results
    folder = tmp_path / "etc-steadyrl"
    folder.mkdir()
    (folder / "tiny-judge.toml").write_text(recipe.read_text())
    printed = dry_run_settings("tiny-judge.toml", 0, ('teacher.path="/models/teacher"', "trainer.distill.coef=1.0"))
    for pool in ("judge", "teacher"):
        name = f"inference-{pool}"
        container = named["Deployment", name]["spec"]["template"]["spec"]["containers"][0]
        settings = recipe_driven("inference", container_env(container, docs), folder, printed, f"pool/{pool}")
        assert (
            settings["pool"] == pool
            and settings["model_path"] == {"judge": "tiny-judge", "teacher": "/models/teacher"}[pool]
        )
        assert (settings["weightsync_address"], settings["orchestrator_address"]) == ("", "")
        assert named["Service", name]["spec"]["clusterIP"] == "None"  # every pod's address under one name
        assert named["Service", name]["spec"]["selector"] == {"app": name}
        scaler = named["ScaledObject", name]["spec"]
        assert scaler["scaleTargetRef"] == {"name": name}
        assert (
            scaler["triggers"][0]["metadata"]["query"]
            == f'sum(steadyrl_pool_queue_depth{{pool="{pool}", namespace="steadyrl"}})'
        )
    rollout = named["Deployment", "inference"]["spec"]["template"]["spec"]["containers"][0]
    replica = recipe_driven("inference", container_env(rollout, docs), folder, printed)
    assert replica["judge"]["addresses"] == ["inference-judge:50052"]
    assert replica["teacher"]["addresses"] == ["inference-teacher:50052"]
    assert named["ScaledObject", "inference"]["spec"]["scaleTargetRef"] == {"name": "inference"}  # untouched
    pools = named["NetworkPolicy", "pools"]["spec"]
    assert pools["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": {"app": "inference"}}}],
            "ports": [{"protocol": "TCP", "port": 50052}],
        }
    ]


def validate_crds(docs: list[dict]) -> list[dict]:
    """Each custom resource checked against its CRD's OpenAPI schema (deploy/schemas/validate.mjs)."""
    installed = subprocess.run([str(ROOT / "scripts" / "crd-schemas")], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-2000:]
    done = subprocess.run(
        ["node", "validate.mjs"],
        input=json.dumps(docs),
        capture_output=True,
        text=True,
        cwd=installed.stdout.strip(),
        check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_custom_resources_validate_against_their_crd_schemas(overlay):
    crds = [
        d
        for d in render(overlay)
        if d["kind"] in ("PodMonitor", "PrometheusRule", "ScaledObject", "AlertmanagerConfig")
    ]
    results = validate_crds(crds)
    assert sorted(r["kind"] for r in results) == ["AlertmanagerConfig", "PodMonitor", "PrometheusRule", "ScaledObject"]
    assert all(r["errors"] == [] for r in results), results
    broken = json.loads(json.dumps(crds))  # the schemas do bite: one mistake in each
    for doc in broken:
        if doc["kind"] == "ScaledObject":
            doc["spec"]["minReplicaCount"] = "two"
        elif doc["kind"] == "PodMonitor":
            doc["spec"]["podMetricsEndpoints"][0]["interval"] = "every 15 s"
        elif doc["kind"] == "AlertmanagerConfig":
            doc["spec"]["inhibitRules"][0]["sourceMatch"][0]["matchType"] = "~~"
        else:
            del doc["spec"]["groups"][0]["rules"][0]["expr"]
    errors = {r["kind"]: r["errors"] for r in validate_crds(broken)}
    assert errors["ScaledObject"] == ["data/spec/minReplicaCount must be integer"]
    assert errors["PodMonitor"][0].startswith("data/spec/podMetricsEndpoints/0/interval must match pattern")
    assert errors["PrometheusRule"] == ["data/spec/groups/0/rules/0 must have required property expr"]
    assert errors["AlertmanagerConfig"][0].startswith(
        "data/spec/inhibitRules/0/sourceMatch/0/matchType must be equal to one of"
    )


def check_gpu_overlay(docs: list[dict]) -> None:
    """What a real GPU run needs of the pods: GPUs and the trainer's launcher from the recipe, long
    startup probes, /dev/shm, the model volume read-only, filled by a Job on a ReadWriteMany claim."""
    pods = {name: d["spec"]["template"]["spec"] for name, d in workloads(docs).items()}
    for name in ("inference", "trainer"):
        pod = pods[name]
        container = pod["containers"][0]
        probe = container["startupProbe"]  # a large model's load is not killed by the liveness probe
        assert "grpc" in probe and probe["failureThreshold"] * probe["periodSeconds"] >= 900, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert (
            volumes["dshm"]["emptyDir"]["medium"] == "Memory"
            and {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        ), name
        assert volumes["models"] == {
            "name": "models",
            "persistentVolumeClaim": {"claimName": "steadyrl-models", "readOnly": True},
        }, name
        assert pod["runtimeClassName"] == "nvidia" and "initContainers" not in pod, name
    env = {e["name"]: e.get("value") for e in pods["inference"]["containers"][0]["env"]}
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert pods["trainer"]["containers"][0]["args"] == [
        "steadyrl.cli",
        "trainer-node",
    ]  # torchrun × trainer.parallel.gpus
    assert "initContainers" not in pods["orchestrator"]
    assert {"name": "data", "mountPath": "/data", "readOnly": True} in pods["orchestrator"]["containers"][0][
        "volumeMounts"
    ]
    claims = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert claims["steadyrl-models"]["accessModes"] == ["ReadWriteMany"]  # a Job can fill it
    assert claims["steadyrl-data"]["accessModes"] == ["ReadWriteMany"]
    fill = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "model-fill")["spec"]["template"]
    container = fill["spec"]["containers"][0]
    assert container["args"][:3] == ["huggingface_hub.cli.hf", "download", "Qwen/Qwen3-30B-A3B"]
    assert container["args"][-2:] == ["--local-dir", "/models/Qwen3-30B-A3B"]  # the recipe's model.path
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "steadyrl-models"}} in fill["spec"]["volumes"]
    egress = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "model-fill-egress")
    assert egress["spec"]["podSelector"] == {
        "matchLabels": {"app": fill["metadata"]["labels"]["app"]}
    }  # it alone leaves


# --- prometheus and grafana ----------------------------------------------------------------------


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: scripts/install installs Debian's prometheus package as root"
    return found


def test_promtool_accepts_the_config_and_the_rules(tmp_path):
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    config = (
        (DEPLOY / "prometheus" / "prometheus.yml")
        .read_text()
        .replace("/etc/prometheus/alerts.yml", str(tmp_path / "alerts.yml"))
    )
    (tmp_path / "prometheus.yml").write_text(config)
    for args in (
        ["check", "config", str(tmp_path / "prometheus.yml")],
        ["check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
    ):
        done = subprocess.run([promtool(), *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_fires_on_a_failure_and_stays_quiet_on_a_healthy_run():
    done = subprocess.run(
        [promtool(), "test", "rules", "alerts_test.yml"], capture_output=True, text=True, cwd=DEPLOY / "prometheus"
    )
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t["alert_rule_test"]]
    fired = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert fired == alerts and quiet == alerts  # each alert: a series it fires on and a healthy one
    assert {
        "SteadyrlServiceDown",
        "SteadyrlNoLiveReplica",
        "SteadyrlTrainerStalled",
        "SteadyrlRolloutsStarved",
        "SteadyrlDeadLetters",
        "SteadyrlWeightSyncFailures",
        "SteadyrlRewardCollapse",
    } <= alerts and "SteadyrlCollapseEarlyWarning" not in alerts  # not shipped: docs/REPRODUCTION.md


def exported_queue_series(redis_url: str, run_id: str, model_dir: Path, tmp_path: Path) -> list[str]:
    """The queue-depth series a real orchestrator exports (its /metrics, run label included) after
    real work on a real Redis: 6 train tasks queued, 2 of them leased, π's eval tasks queued
    and one leased, one task completed."""
    import asyncio

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from services.orchestrator.server import create_app
    from shared.runstore.queues import WorkQueue
    from tests.integration.test_control_plane import orchestrator_on

    async def main() -> str:
        redis, orchestrator = await orchestrator_on(
            redis_url,
            run_id,
            model_dir,
            tmp_path,
            "running",
            batch_prompts=4,
            group_size=2,
            steps=10,
            lookahead_batches=0,
        )
        assert await orchestrator.admit() == 8
        tasks = [orchestrator.tasks.make(f"evalpi-{i}", orchestrator.tasks.train[i], 1, 0.0, True, 0) for i in range(3)]
        await orchestrator.queue.submit_many(tasks)
        rollouts = WorkQueue(redis, run_id)
        policy = WorkQueue(redis, run_id, pool="policy_eval")
        leased = await rollouts.lease("r0", 60, count=3)
        assert await rollouts.complete("r0", leased[0].task_id, [b"x", b"y"])
        await policy.lease("r1", 60, count=1)
        await orchestrator.tick()
        transport = httpx.ASGITransport(app=create_app(orchestrator, "token"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            text = (await http.get("/metrics")).text
        await orchestrator.close()
        await redis.aclose()
        return text

    text = asyncio.run(asyncio.wait_for(main(), 60))
    series = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "steadyrl_orchestrator_queue_depth":
                labels = ", ".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                series.append((labels, sample.value))
    return series


def test_the_inference_scaler_counts_this_run_s_rollout_work_alone(redis_server, run_id, tiny_model_dir, tmp_path):
    """KEDA's query (the gpu overlay's), by promtool, on the series a real orchestrator exported
    after real queue work (its own `run` label, the namespace Prometheus adds) beside the same
    series of another run and of another namespace: it sums this run's train tasks queued and
    leased (5 + 2 = 7), not μ's eval round (5 tasks queued with them in the rollouts pool), π's
    (pending_policy, leased_policy), completed ones, the stream, nor any other run's work."""
    scaler = next(d for d in render("gpu") if d["kind"] == "ScaledObject")
    query = scaler["spec"]["triggers"][0]["metadata"]["query"]
    run = RECIPES["gpu"][1]
    exported = exported_queue_series(redis_server.url, run, tiny_model_dir, tmp_path)
    depth = {re.search(r'state="(\w+)"', labels).group(1): value for labels, value in exported}
    assert {f.name for f in dataclasses.fields(QueueDepths)} == set(depth)  # the orchestrator exports each field
    assert (depth["pending"], depth["leased"], depth["pending_policy"], depth["leased_policy"]) == (10, 2, 2, 1)
    assert (depth["pending_eval"], depth["leased_eval"]) == (5, 0)  # μ's baseline eval round, queued by the tick
    assert all(f'run="{run}"' in labels for labels, _ in exported)
    series = []
    for labels, value in exported:
        for namespace, other in (("steadyrl", ""), ("steadyrl", "other-run"), ("elsewhere", "")):
            text = labels.replace(f'run="{run}"', f'run="{other}"') if other else labels
            series.append(
                {
                    "series": f'steadyrl_orchestrator_queue_depth{{{text}, namespace="{namespace}", '
                    f'job="steadyrl-orchestrator"}}',
                    "values": f"{value:g}x5",
                }
            )
    case = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [{"expr": query, "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": 7}]}],
            }
        ],
    }
    (tmp_path / "scaler_test.yml").write_text(yaml.safe_dump(case))
    done = subprocess.run(
        [promtool(), "test", "rules", "scaler_test.yml"], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def exported_metric_names() -> set[str]:
    """Every sample name the services register (counters as _total, histograms as _bucket...)."""
    import importlib

    from prometheus_client import REGISTRY

    for module in (
        "services.weightsync.server",
        "services.inference.worker",
        "services.inference.server",
        "services.trainer.loop",
        "services.orchestrator.orchestrator",
        "services.orchestrator.server",
    ):
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
    assert dashboard["templating"]["list"][0] == {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
    }
    run = dashboard["templating"]["list"][1]  # a run variable: two runs in one Prometheus stay apart
    assert run["name"] == "run" and run["query"]["query"] == "label_values(steadyrl_orchestrator_queue_depth, run)"
    selectors = [m for e in exprs for m in re.findall(r"(?:steadyrl_|vllm:)[a-z0-9_]+(\{[^}]*\})?", e)]
    assert selectors and all('run=~"$run"' in m for m in selectors)  # every series of the panels scoped to it
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    named = {m for e in exprs for m in re.findall(r"steadyrl_[a-z0-9_]+", e)}
    assert named and not (named - exported), sorted(named - exported)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in (
        "reward",
        "entropy",
        "mismatch kl",
        "is weights",
        "clip",
        "staleness",
        "routing agreement",
        "first-order",
        "tokens/s",
        "queue",
        "weight-sync",
        "version",
        "weight publishes and failures",
        "in-flight tasks",
        "running sequences",
        "leases lost",
        "loading",
        "kv-cache usage",
    ):
        assert topic in titles, topic
    used = " ".join(exprs)
    for name in ("mismatch_kl_k3", "entropy", "staleness_peak"):  # the collapse and budget alerts
        assert name in used


def test_a_real_prometheus_scrapes_a_running_service(tmp_path):
    from shared.weightsync.signing import write_key_pair

    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus is missing: scripts/install installs Debian's package as root"
    grpc_port = free_port()
    metrics_port = free_port()
    web_port = free_port()
    env = {
        **os.environ,
        "STEADYRL_WEIGHTSYNC_PORT": str(grpc_port),
        "STEADYRL_WEIGHTSYNC_METRICS_PORT": str(metrics_port),
        "STEADYRL_WEIGHTSYNC_SPILL_DIR": str(tmp_path / "spill"),
        "STEADYRL_WEIGHTSYNC_RUN_ID": "scraped-run",
        "STEADYRL_WEIGHTSYNC_VERIFY_KEY_FILE": str(write_key_pair(tmp_path / "keys")[1]),
    }
    service = subprocess.Popen([sys.executable, "-m", "services.weightsync"], env=env)
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "steadyrl-weightsync", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}
                ],
            }
        )
    )
    server = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import httpx

        result = []
        for _ in range(120):
            time.sleep(0.5)
            try:
                reply = httpx.get(
                    f"http://127.0.0.1:{web_port}/api/v1/query",
                    params={"query": "steadyrl_weightsync_versions_held"},
                    timeout=2,
                ).json()
            except httpx.HTTPError:
                continue
            result = reply.get("data", {}).get("result", [])
            if result:
                break
        assert result and result[0]["metric"]["job"] == "steadyrl-weightsync"
        assert result[0]["metric"]["run"] == "scraped-run"  # the service labels its samples with its run
        assert float(result[0]["value"][1]) == 0.0  # nothing pushed yet
    finally:
        for process in (server, service):
            process.send_signal(signal.SIGTERM)
            process.wait(20)


def test_replay_alerts_fires_on_a_collapsing_series_and_not_on_a_healthy_one():
    """`steadyrl replay-alerts`: a run's metrics, one step per minute, through promtool. Staleness 3
    over a budget of 1 fires after
    10 steps; a reward falling from 0.4 to 0.1 at step 61 fires the reward collapse at step 91 (past
    an hour: promtool then prints "1h30m"); the eval round of step 75, 25 points under the best, fires
    the eval drop from there; π's round of step 25, 15 points under its first (step 0), is a dip (the
    next is back above), and π under its start fires from its round of step 80, the second in a row
    more than 10 points under; flat series never do."""
    from steadyrl.alert_replay import firing_steps, minutes, replayed_alerts

    rules = DEPLOY / "prometheus" / "alerts.yml"
    assert replayed_alerts(rules) == [
        "SteadyrlRewardCollapse",
        "SteadyrlEvalDrop",
        "SteadyrlPolicyUnderStart",
        "SteadyrlStalenessOverBudget",
    ]
    assert (minutes("45m"), minutes("1h30m"), minutes("1d2h"), minutes("0s")) == (45, 90, 1560, 0)
    kl = [0.005] * 41 + [0.01 * 2**i for i in range(9)] + [2.56] * 50
    collapsing = [
        {
            "step": i + 1,
            "mismatch_kl_k3": k,
            "entropy": 0.5 - 0.002 * min(i, 49),
            "staleness_peak": 3 * (30 <= i < 50),
            "reward_mean": 0.4 if i < 60 else 0.1,
            "recipe": "minirl",
        }
        for i, k in enumerate(kl)
    ]
    budget = {"steadyrl_trainer_max_staleness": 1}
    evals = [
        {"step": 0, "accuracy": 0.4},
        {"step": 50, "accuracy": 0.45, "sets": {"main": {"accuracy": 0.45}}},
        {"step": 75, "accuracy": 0.2},
    ]
    policy = [
        {"step": 0, "accuracy": 0.5},
        {"step": 25, "accuracy": 0.35},
        {"step": 40, "accuracy": 0.55},
        {"step": 60, "accuracy": 0.38},
        {"step": 80, "accuracy": 0.35},
    ]
    fired = firing_steps(collapsing, rules, budget, evals, policy)
    assert fired == {
        "SteadyrlRewardCollapse": list(range(91, 101)),
        "SteadyrlEvalDrop": list(range(75, 101)),
        "SteadyrlPolicyUnderStart": list(range(80, 101)),
        "SteadyrlStalenessOverBudget": list(range(41, 51)),
    }
    healthy = [{**row, "mismatch_kl_k3": 0.005, "staleness_peak": 1, "reward_mean": 0.4} for row in collapsing]
    steady = [{"step": e["step"], "accuracy": 0.4} for e in evals]
    assert firing_steps(healthy, rules, budget, steady, steady) == {a: [] for a in fired}


def test_the_alerts_on_a_collapsed_grid_run():
    """A real run of paper-grid-fp4.toml's N = 1 w/o IS at lr 4e-3 (seed 0, 300 steps; the series the
    rules read, docs/reproduction/fp4-live-pi/collapsed-run): π 0.32 → 0.215 at version 25 → 0.01.
    π's alert fires from its second round in a row under the start (version 50), with μ's eval drop,
    the reward collapse 28 steps later."""
    from steadyrl.alert_replay import replay_run

    fired = replay_run(
        ROOT / "docs" / "reproduction" / "fp4-live-pi" / "collapsed-run", DEPLOY / "prometheus" / "alerts.yml"
    )["firing_steps"]
    assert fired["SteadyrlPolicyUnderStart"] == list(range(50, 301))
    assert fired["SteadyrlEvalDrop"][0] == 50 and fired["SteadyrlRewardCollapse"][0] == 78
    assert fired["SteadyrlStalenessOverBudget"] == []


def test_replay_alerts_reads_an_older_run_s_staleness_max_as_staleness_peak(tmp_path):
    """Runs written before the rename (the collapsed grid run's metrics.jsonl) name the measured
    staleness `staleness_max`: replayed, it is the `staleness_peak` the budget alert reads."""
    from steadyrl.alert_replay import replay_run

    rows = [{"step": s, "staleness_max": 3.0} for s in range(1, 21)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.resolved.toml").write_text("[run]\nmax_staleness = 1\n")
    fired = replay_run(tmp_path, DEPLOY / "prometheus" / "alerts.yml")["firing_steps"]
    assert fired["SteadyrlStalenessOverBudget"] == list(range(11, 21))


def test_replay_alerts_says_when_promtool_cannot_run_the_rules(tmp_path):
    from steadyrl.alert_replay import firing_steps

    rules = tmp_path / "rules.yml"
    rules.write_text(
        'groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: steadyrl_trainer_last_metric{name="x"} >\n'
    )
    with pytest.raises(RuntimeError, match="promtool failed"):
        firing_steps([{"step": 1, "x": 1.0}], rules)
