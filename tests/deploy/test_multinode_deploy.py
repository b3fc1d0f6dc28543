"""The multi-node trainer's launch files, checked offline: the Slurm script run with a stand-in
for srun (what it would start, resolved by `steadyrl trainer-node --dry-run`), and the JobSet
component rendered into the gpu overlay, its pod template validated as a Kubernetes Job and its
command resolved the same way. Both meet at weight-sync (torchrun's `steadyrl` rendezvous): no
rendezvous port, a rendezvous id per launch of the job."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.deploy.test_deploy import (
    DEPLOY,
    ROOT,
    check_settings,
    container_env,
    copy_deploy,
    render,
    steadyrl_env,
)

SRUN = """#!/bin/bash
# srun stand-in: record the flags, run the command once as --dry-run
flags=()
while [[ "$1" == --* ]]; do flags+=("$1"); shift; done
printf '%s\\n' "${flags[@]}" > "$RECORD.flags"
"$@" --dry-run > "$RECORD.json"
"""


def dry_run(env: dict[str, str], *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "steadyrl.cli", "trainer-node", *args, "--dry-run"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_slurm_script_starts_one_trainer_node_per_node_meeting_at_weightsync(tmp_path):
    (tmp_path / "srun").write_text(SRUN)
    (tmp_path / "srun").chmod(0o755)
    script = DEPLOY / "slurm" / "trainer.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = {
        **os.environ,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "RECORD": str(tmp_path / "srun"),
        "PYTHON": sys.executable,
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_RESTART_COUNT": "1",  # requeued once: a new job at the rendezvous
        "RECIPE": "configs/gpu-qwen3-moe-math.toml",
        "STEADYRL_TRAINER_REDIS_URL": "redis://:secret-pw@redis:6379/0",
        "STEADYRL_TRAINER_OUT_DIR": "/shared/run/trainer",
        "STEADYRL_TRAINER_WEIGHTSYNC_ADDRESS": "weightsync-host:50051",
        "STEADYRL_TRAINER_PUBLISH__SIGNING_KEY_FILE": "/shared/secrets/weights-signing-key",
    }
    done = subprocess.run(["bash", str(script)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "srun.flags").read_text().split() == ["--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    plan = json.loads((tmp_path / "srun.json").read_text())
    argv = plan["argv"][1:]
    assert argv == [
        "-m",
        "steadyrl.torchrun",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "8",
        "--rdzv-backend",
        "steadyrl",
        "--rdzv-endpoint",
        "weightsync-host:50051",
        "--rdzv-id",
        "slurm-4242.1",
        "--rdzv-conf",
        "join_timeout=600",
        "--max-restarts",
        "3",
        "-m",
        "services.trainer",
    ]
    trainer = plan["env"]
    assert trainer["STEADYRL_TRAINER_PARALLEL__NODES"] == "2" and trainer["STEADYRL_TRAINER_PARALLEL__GPUS"] == "8"
    assert trainer["STEADYRL_TRAINER_OUT_DIR"] == "/shared/run/trainer"  # the environment wins over the recipe
    assert trainer["STEADYRL_TRAINER_PARALLEL__COLLECTIVE_TIMEOUT_SECONDS"] == "600"
    assert "secret-pw" not in (tmp_path / "srun.json").read_text()  # the Redis password is masked
    # without its inputs the script stops before srun, naming what is missing
    for name in ("RECIPE", "STEADYRL_TRAINER_WEIGHTSYNC_ADDRESS"):
        missing = subprocess.run(
            ["bash", str(script)],
            env={k: v for k, v in env.items() if k != name},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert missing.returncode != 0 and name in missing.stderr


def test_trainer_node_refuses_a_multi_node_recipe_without_a_rendezvous_or_a_node_rank_past_the_nodes():
    """Each refusal names the setting by its one dotted path (and how to set it), never `trainer.trainer.…`."""
    env = {**os.environ, "STEADYRL_TRAINER_MODEL_PATH": "/models/m", "STEADYRL_TRAINER_PARALLEL__NODES": "2"}
    unset = (
        "trainer.parallel.rdzv_endpoint is unset: the nodes meet at the weight-sync service, so set it to that "
        "service's host:port (--set trainer.parallel.rdzv_endpoint=HOST:PORT, or "
        "STEADYRL_TRAINER_PARALLEL__RDZV_ENDPOINT)"
    )
    for extra, args, said in (
        ({}, [], "trainer.parallel.nodes = 2 needs trainer.parallel.rdzv_endpoint = 'host:port'"),
        (
            {"STEADYRL_TRAINER_PARALLEL__RDZV_ENDPOINT": "weightsync:50051"},
            ["--node-rank", "2"],
            "--node-rank 2 is past the last node: trainer.parallel.nodes = 2, ranks 0 to 1",
        ),
        ({"STEADYRL_TRAINER_PARALLEL__NODES": "1"}, ["configs/tiny-arith.toml"], unset),  # a single-node recipe
        (
            {"STEADYRL_TRAINER_PARALLEL__NODES": "1"},
            ["configs/tiny-arith.toml", "--node-rank", "1"],
            "--node-rank 1 is past the last node: trainer.parallel.nodes = 1, ranks 0",
        ),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "steadyrl.cli", "trainer-node", *args, "--dry-run"],
            env={**env, **extra},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and said in done.stderr and "trainer.trainer" not in done.stderr, done.stderr


def jobset_errors(jobset: dict) -> list[str]:
    """The JobSet against its CRD's schema (deploy/schemas/jobset.x-k8s.io_v1alpha2.json, upstream's
    with the Job spec pruned), strict like kubernetes-validate: a field the schema does not name is
    an error."""
    import jsonschema

    def strict(node):
        if isinstance(node, dict):
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)
        return node

    schema = strict(json.loads((DEPLOY / "schemas" / "jobset.x-k8s.io_v1alpha2.json").read_text()))
    validator = jsonschema.Draft7Validator(schema)
    return sorted(f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(jobset))


def test_the_jobset_component_runs_the_trainer_over_nodes_with_rank_0_behind_the_service(tmp_path):
    import kubernetes_validate

    deploy = copy_deploy(tmp_path)
    with open(deploy / "k8s" / "overlays" / "gpu" / "kustomization.yaml", "a") as f:
        f.write("components:\n  - ../../components/multinode-trainer\n")
    docs = render("gpu", deploy)
    assert not [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "trainer"]
    jobset = next(d for d in docs if d["kind"] == "JobSet")
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert jobset_errors(jobset) == []  # the CRD's schema; the Job template below, Kubernetes' own
    broken = json.loads(json.dumps(jobset))
    broken["spec"]["failurePolicy"]["maxRestarts"] = "three"
    broken["spec"]["replicatedJob"] = broken["spec"].pop("replicatedJobs")
    assert jobset_errors(broken) == [
        "spec/failurePolicy/maxRestarts: 'three' is not of type 'integer'",
        "spec: Additional properties are not allowed ('replicatedJob' was unexpected)",
    ]
    spec = jobset["spec"]
    assert spec["failurePolicy"]["maxRestarts"] >= 1 and spec["network"]["enableDNSHostnames"] is True
    [nodes] = spec["replicatedJobs"]
    job = nodes["template"]
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "trainer-node"}, "spec": job["spec"]},
        version,
        strict=True,
    )
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == job["spec"]["completions"]
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = container_env(container, docs)
    check_settings("trainer", steadyrl_env(env, "trainer"))
    assert env["STEADYRL_RECIPE"] == "/etc/steadyrl/gpu-qwen3-moe-math.toml"  # the gpu overlay's recipe...
    assert env["STEADYRL_TRAINER_PARALLEL__NODES"] == str(job["spec"]["parallelism"])  # ...spread over the nodes
    # the nodes meet at weight-sync's gRPC port, a job name per restart attempt of the JobSet
    assert env["STEADYRL_TRAINER_PARALLEL__RDZV_ENDPOINT"] == "weightsync:50051"
    assert env["STEADYRL_TRAINER_PARALLEL__RDZV_ID"] == "trainer-attempt-$(JOBSET_RESTART_ATTEMPT)"
    names = [e["name"] for e in container["env"]]  # $(VAR) resolves only from variables listed before it
    assert names.index("JOBSET_RESTART_ATTEMPT") < names.index("STEADYRL_TRAINER_PARALLEL__RDZV_ID")
    assert {p["name"] for p in container["ports"]} == {"grpc", "metrics"}  # no rendezvous port
    collective = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "weights-collective")
    admitted = collective["spec"]["ingress"][0]["ports"][0]
    sysctls = {s["name"]: s["value"] for s in pod["securityContext"]["sysctls"]}
    assert sysctls["net.ipv4.ip_local_port_range"] == f"{admitted['port']} {admitted['endPort']}"  # broadcasts pass
    assert container["args"] == ["steadyrl.cli", "trainer-node", "--node-rank", "$(JOB_COMPLETION_INDEX)"]
    recipe = {
        "STEADYRL_RECIPE": str(ROOT / "configs" / "gpu-qwen3-moe-math.toml"),
        "STEADYRL_TRAINER_PARALLEL__RDZV_ID": "trainer-attempt-2",  # as the kubelet resolves it
    }
    resolved = dry_run({**os.environ, **steadyrl_env(env, "trainer"), **recipe}, "--node-rank", "1")
    assert resolved["argv"][1:] == [
        "-m",
        "steadyrl.torchrun",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "8",
        "--rdzv-backend",
        "steadyrl",
        "--rdzv-endpoint",
        "weightsync:50051",
        "--rdzv-id",
        "trainer-attempt-2",
        "--rdzv-conf",
        "join_timeout=600,node_rank=1",
        "--max-restarts",
        "3",
        "-m",
        "services.trainer",
    ]
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "trainer")
    assert service["spec"]["selector"] == {"app": "trainer", "batch.kubernetes.io/job-completion-index": "0"}
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert claims["trainer-data"]["spec"]["accessModes"] == ["ReadWriteMany"]  # every node writes its shards
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "trainer-data"}} in pod["volumes"]
    assert env["STEADYRL_TRAINER_PARALLEL__MODE"] == "hsdp" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    trainer = resolved["env"]  # B, G, N, precision... come from the recipe, not the JobSet
    assert (
        trainer["STEADYRL_TRAINER_BATCH_PROMPTS"],
        trainer["STEADYRL_TRAINER_MINI_BATCHES"],
        trainer["STEADYRL_TRAINER_COMPUTE__PRECISION"],
        trainer["STEADYRL_TRAINER_RUN_ID"],
    ) == ("64", "4", "bf16-mixed", "qwen3-moe-math")
    assert not {
        "STEADYRL_TRAINER_BATCH_PROMPTS",
        "STEADYRL_TRAINER_PARALLEL__GPUS",
        "STEADYRL_TRAINER_COMPUTE__PRECISION",
    } & set(env)
    assert yaml.safe_dump(jobset)  # renders back
    assert Path(deploy / "slurm" / "trainer.sbatch").exists()
