"""The whole system on loopback: `steadyrl run` on the tiny demo recipe, and an orchestrator
restart in the middle of a run."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.weightsync.shm_folders import claim_run_folder
from tests.helpers import read_scalars

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
TRAINER_KEYS = (
    "step",
    "version",
    "reward_mean",
    "entropy",
    "mismatch_kl_k1",
    "mismatch_kl_k3",
    "is_weight_mean",
    "is_weight_max",
    "is_truncated_frac",
    "clip_frac",
    "staleness_mean",
    "staleness_peak",
    "dropped_stale",
    "routing_agreement",
    "first_order_error",
    "grad_norm",
    "tokens_per_s",
    "step_seconds",
    "trainer_wait_seconds",
    "trainer_idle_share",
)


def alive(pid: int) -> bool:
    """Running (a zombie left to an init that does not reap it has stopped: not alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rpartition(")")[2].split()[0] == "Z")


def test_steadyrl_run_tiny_arith_end_to_end(tmp_path, tiny_model_dir, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_SILENT", "true")
    mlflow = f"file://{tmp_path / 'mlruns'}"  # MLflow's store on disk (no server here), W&B offline
    hard = tmp_path / "hard.csv"  # a named eval set beside the task's own: 3-digit sums the model never saw
    hard.write_text("prompt,answer\n" + "".join(f"{a}+{b}=,{str(a + b)[::-1]}\n" for a, b in [(123, 456), (900, 99)]))
    # another run of this recipe living on this host (its claim held), with its version files: this
    # one must not touch them (tests/unit/test_shm_folders.py: a dead run's are removed)
    shm = tmp_path / "shm"
    sibling = shm / "tiny-arith" / ("ab" * 16)
    sibling.mkdir(mode=0o700, parents=True)
    for version in (1, 2, 3):
        (sibling / f"v{version}.safetensors").write_bytes(b"another run's version %d" % version)
    claim = claim_run_folder(shm, "tiny-arith", sibling.name)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / "tiny-arith.toml"),
            "--out",
            str(out),
            "--set",
            "run.steps=4",
            "--set",
            "run.batch_prompts=8",
            "--set",
            "orchestrator.evals.every=2",
            "--set",
            "orchestrator.evals.size=40",
            "--set",
            "run.replicas=2",
            "--set",
            "trainer.checkpoint.every=2",
            "--set",
            f'orchestrator.evals.sets={{hard = "{hard}"}}',
            "--set",
            "orchestrator.evals.policy=true",
            "--set",
            f"trainer.publish.shm_dir={shm}",
            "--set",
            f'run.tracking={{wandb_project = "e2e", wandb_mode = "offline", mlflow_tracking_uri = "{mlflow}"}}',
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the banner: each service's gRPC and /metrics addresses as it turns healthy, then the control plane's URL
    for name in ("weightsync", "trainer", "inference-0", "inference-1", "inference-policy", "orchestrator"):
        address = rf"^  {name} +healthy: gRPC 127\.0\.0\.1:\d+, metrics http://127\.0\.0\.1:\d+/metrics$"
        assert re.search(address, done.stderr, re.MULTILINE), (name, done.stderr[:3000])
    started = (out / "logs" / "orchestrator.log").read_text()
    http_port = re.search(r"event=started service=orchestrator .*http_port=(\d+)", started)[1]
    token = re.escape(str(out / "token"))
    control = rf"^  control plane  http://127\.0\.0\.1:{http_port}  /v1/run, /docs \(bearer token: {token}\)$"
    assert re.search(control, done.stderr, re.MULTILINE), done.stderr[:3000]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == 4 and summary["versions"] == 4, summary
    # every replica reported and ended on the last version
    assert summary["final_status"]["replica_versions"] == {"replica-0": 4, "replica-1": 4, "replica-policy": 4}, (
        summary["final_status"]
    )
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    # the trainer's idle share: step 1 waited for everything before it; the summary, the mean of the others
    idle = [x["trainer_idle_share"] for x in lines]
    assert idle[0] == 1.0 and all(0 <= share < 1 for share in idle[1:]), idle
    assert all(x["trainer_wait_seconds"] >= 0 for x in lines)
    assert summary["trainer_idle_share"] == round(sum(idle[1:]) / 3, 3)
    # the rollout replicas' idle share from their heartbeats (π's eval replica reports none), on every
    # step from the first heartbeat the orchestrator recorded (a replica can start before it listens)
    replica_idle = [x["replica_idle_share"] for x in lines[1:] if "replica_idle_share" in x]
    assert "replica_idle_share" in lines[-1] and all(0 <= share <= 1 for share in replica_idle), replica_idle
    assert summary["replica_idle_share"] == round(sum(replica_idle) / len(replica_idle), 3)
    for key in TRAINER_KEYS:
        assert all(key in x for x in lines), key
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2, 4] and all(0 <= e["accuracy"] <= 1 for e in evals), evals
    assert evals[0]["policy_version_max"] == 0  # the cold start is scored before any version lands
    assert all(e["sets"]["main"]["prompts"] == 40 and e["sets"]["hard"]["prompts"] == 2 for e in evals)
    assert all(e["sets"]["main"]["accuracy"] == e["accuracy"] for e in evals)
    # π's rounds, served by the policy_eval replica: unquantised like the rollout replicas here, so at
    # version 0 it answers what they answer (up to 2 of 40 greedy answers: the replicas batch the
    # prompts differently, and bf16 matmuls round by batch shape)
    policy = [json.loads(x) for x in (out / "policy-eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in policy] == [0, 2, 4] and policy[0]["policy_version_max"] == 0, policy
    assert [(e["sets"]["main"]["prompts"], e["sets"]["hard"]["prompts"]) for e in policy] == [(40, 2)] * 3, policy
    assert abs(policy[0]["accuracy"] - evals[0]["accuracy"]) <= 2 / 40, (policy[0], evals[0])
    assert summary["policy_eval_start"] == policy[0]["accuracy"] and len(summary["policy_evals"]) == 3

    scalars = read_scalars(out / "trainer" / "tensorboard")  # TensorBoard: every numeric key, every step
    numeric = {k for x in lines for k, v in x.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    numeric.discard("unix_ms")  # when the line was written: the step's time, not a scalar of it
    assert numeric <= set(scalars) and len(numeric) >= len(TRAINER_KEYS)
    assert [step for step, _ in scalars["reward_mean"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["reward_mean"]] == pytest.approx([x["reward_mean"] for x in lines], rel=1e-6)
    eval_scalars = read_scalars(out / "orchestrator" / "tensorboard")
    assert [step for step, _ in eval_scalars["eval_accuracy"]] == [0, 2, 4]
    assert [value for _, value in eval_scalars["eval_set/hard/accuracy"]] == [
        e["sets"]["hard"]["accuracy"] for e in evals
    ]
    # W&B and MLflow got what TensorBoard got: the trainer's steps and the orchestrator's evals
    from tests.helpers import mlflow_history, wandb_history

    def same(series, expected):  # TensorBoard keeps float32
        assert [s for s, _ in series] == [s for s, _ in expected]
        assert [v for _, v in series] == pytest.approx([v for _, v in expected], rel=1e-6)

    same(wandb_history(out / "trainer")["reward_mean"], scalars["reward_mean"])
    same(mlflow_history(mlflow, "tiny-arith/trainer")[0]["reward_mean"], scalars["reward_mean"])
    for history in (wandb_history(out / "orchestrator"), mlflow_history(mlflow, "tiny-arith/orchestrator")[0]):
        same(history["eval_accuracy"], eval_scalars["eval_accuracy"])
    # no terminal: plain progress lines as the run goes, not one frame at the end
    shown = [int(step) for step in re.findall(r"^progress step=(\d+)/4 ", done.stderr, re.MULTILINE)]
    assert len(set(shown)) >= 2 and shown == sorted(shown) and shown[-1] == 4, done.stderr[-2000:]
    assert len(summary["plots"]) >= 8 and (out / "config.resolved.toml").exists()
    # every process on one host: the versions went through shared memory, and the recipe says so
    assert (out / "logs" / "weightsync.log").read_text().count("transport=shm") >= 4
    assert 'trainer.publish.transport "shm"' in (out / "config.resolved.toml").read_text()
    # its version files went to a folder of its own instance, removed at the end; the other run's stay
    os.close(claim)
    assert sorted(p.name for p in (shm / "tiny-arith").iterdir()) == [f".{sibling.name}.lock", sibling.name]
    assert {p.name: p.read_bytes() for p in sibling.iterdir()} == {
        f"v{v}.safetensors": b"another run's version %d" % v for v in (1, 2, 3)
    }
    time.sleep(0.5)
    assert not [pid for pid in json.loads((out / "pids.json").read_text()).values() if alive(pid)]  # no orphan
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final-model")  # loadable by transformers
    assert sum(p.numel() for p in model.parameters()) == 230_848
    export_round_trip(out, tmp_path)
    # the trainer wrote the final model at its last step (the launcher moved it into place): what
    # `steadyrl export` makes of the last checkpoint, tensor for tensor, config for config
    import torch
    from safetensors.torch import load_file

    assert "event=final_model_written step=4 " in (out / "logs" / "trainer.log").read_text()
    final, exported = (load_file(d / "model.safetensors") for d in (out / "final-model", tmp_path / "float32"))
    assert final.keys() == exported.keys() and all(torch.equal(final[k], exported[k]) for k in final)
    configs = [json.loads((d / "config.json").read_text()) for d in (out / "final-model", tmp_path / "float32")]
    assert configs[0] == configs[1] and configs[0]["use_cache"] is True  # the trainer's own turns it off
    assert not (out / "final-model" / "exported-step.json").exists()


@pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],  # slow: the same shutdown as SIGTERM
    ids=["sigterm", "sigint"],
)
def test_a_signalled_run_stops_every_process_it_started(tmp_path, tiny_model_dir, sig):
    out = tmp_path / "run"
    # SIG_IGN for SIGINT, as a shell gives a background job: the run must still honour it
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / "tiny-arith.toml"),
            "--out",
            str(out),
            "--set",
            "run.steps=100000",
            "--set",
            "orchestrator.evals.every=0",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    deadline = time.monotonic() + 300
    while not (out / "pids.json").exists():  # written once every service is healthy
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    pids = list(json.loads((out / "pids.json").read_text()).values())
    assert len(pids) == 5 and all(alive(pid) for pid in pids)  # 4 services and redis-server
    time.sleep(2.0)
    process.send_signal(sig)
    assert process.wait(60) == 130  # interrupted
    time.sleep(0.5)
    assert not [pid for pid in pids if alive(pid)]
    assert json.loads((out / "summary.json").read_text())["outcome"] == "interrupted"


def test_a_trainer_stopped_with_sigterm_mid_run_is_restarted_and_the_run_trains_every_step(tmp_path, tiny_model_dir):
    """SIGTERM stops a trainer cleanly (it checkpoints, exits 0): before the run's last step that is no
    end of the run, and the supervisor starts it again like a crashed one (the run used to wait forever)."""
    from tests.helpers import kill_mid_run

    out = tmp_path / "run"
    settings = ["run.steps=12", "orchestrator.evals.every=0", "run.restart_backoff_seconds=0.2"]
    run = kill_mid_run(ROOT / "configs" / "tiny-arith.toml", out, settings, 4, ["trainer"], signal.SIGTERM)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"event=service_exited service=trainer code=0 ", run.stderr), run.stderr[-3000:]
    assert "event=service_restarted service=trainer" in run.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == 12 and run.killed_at < 12
    steps = [line["step"] for line in map(json.loads, (out / "trainer" / "metrics.jsonl").read_text().splitlines())]
    assert steps == list(range(1, 13))  # the stop's checkpoint kept every step: none trained twice, none lost


LAUNCHER = """
import json, sys, time
from pathlib import Path
from steadyrl.processes import Launch
from steadyrl.recipe import load_recipe

launch = Launch(load_recipe(Path(sys.argv[1]), []), Path(sys.argv[2]), sys.argv[3])
launch.start_redis()
launch.plan(launch.redis.url)
for service in launch.services:
    if service.name in ("weightsync", "orchestrator"):
        launch.start(service)
print(json.dumps([launch.redis.process.pid] + [s.process.pid for s in launch.services if s.process]), flush=True)
time.sleep(600)
"""


def test_a_sigkilled_launcher_takes_its_services_and_redis_with_it(tmp_path, tiny_model_dir):
    """A launcher killed outright can stop nothing itself: the kernel sends each process it started
    (services, redis-server) SIGTERM as it dies (PR_SET_PDEATHSIG), and each stops."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(ROOT / "configs" / "tiny-arith.toml"), str(tmp_path), str(tiny_model_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = json.loads(launcher.stdout.readline())
    try:
        assert len(pids) == 3 and all(alive(pid) for pid in pids)
        time.sleep(3.0)  # the services are importing, or up
        launcher.kill()
        assert launcher.wait(10) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while [pid for pid in pids if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in pids if alive(pid)], "processes outlived their killed launcher"
    finally:
        for pid in pids:  # whatever this test found, it leaves nothing running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_orchestrator_restart_mid_run_loses_and_duplicates_nothing(tmp_path, tiny_model_dir):
    import asyncio

    from redis.asyncio import Redis

    from shared.runstore.redis_server import RedisServer
    from steadyrl.processes import Launch
    from steadyrl.recipe import load_recipe

    config = load_recipe(
        ROOT / "configs" / "tiny-arith.toml",
        ["run.steps=6", "run.batch_prompts=4", "orchestrator.evals.every=0", "trainer.checkpoint.every=1"],
    )
    launch = Launch(config, tmp_path, str(tiny_model_dir))
    try:
        launch.redis = RedisServer(tmp_path / "redis").start()
        launch.plan(launch.redis.url)
        for service in launch.services:
            launch.start(service)
            launch.wait_healthy(service)
        launch.api("POST", "/v1/run/start")
        orchestrator = launch.services[-1]
        while launch.api("GET", "/v1/run")["trainer_version"] < 2:
            time.sleep(0.1)
        os.kill(orchestrator.process.pid, signal.SIGKILL)  # mid-run, with work queued and leased
        orchestrator.process.wait(10)
        launch.start(orchestrator)
        launch.wait_healthy(orchestrator)
        deadline = time.monotonic() + 300
        while (status := launch.api("GET", "/v1/run"))["state"] != "finished":
            assert time.monotonic() < deadline, status
            time.sleep(0.2)

        async def ledger():
            redis = Redis.from_url(launch.redis.url)
            prefix = f"steadyrl:{config.run_id}:"
            trained = [x.decode() for x in await redis.lrange(prefix + "trained", 0, -1)]
            dropped = [x.decode() for x in await redis.lrange(prefix + "trained:dropped", 0, -1)]
            submitted = int(await redis.hget(prefix + "run", "submitted"))
            dead = await redis.xlen(prefix + "dead")
            await redis.aclose()
            return trained, dropped, submitted, dead

        trained, dropped, submitted, dead = asyncio.run(ledger())
    finally:
        launch.stop_all()
    trained_tasks, dropped_tasks = ({rid.split(":")[0] for rid in ids} for ids in (trained, dropped))
    assert len(trained) == len(set(trained)) == 6 * 4 * 8  # every rollout trained once
    # a task is trained or dropped as stale (whole, once; the orchestrator queues another in its place), and
    # the task numbers run without a gap: none lost, none extra
    assert len(dropped) == len(set(dropped)) == 8 * len(dropped_tasks) and not trained_tasks & dropped_tasks
    assert sorted(trained_tasks | dropped_tasks, key=lambda t: int(t.split("-")[1])) == [
        f"train-{i}" for i in range(submitted)
    ], (sorted(trained_tasks), sorted(dropped_tasks), submitted)
    assert submitted == 24 + len(dropped_tasks) and dead == 0


def export_round_trip(run_dir, tmp_path):
    """`steadyrl export` of the run's last checkpoint: transformers loads it, and its greedy outputs
    equal the trainer's own model (the base model with the checkpoint's weights) on 20 prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.trainer.checkpoint import latest_checkpoint, load_model_weights
    from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts

    summary = json.loads((run_dir / "summary.json").read_text())
    for dtype in ("float32", "bfloat16"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "steadyrl.cli",
                "export",
                str(run_dir),
                "--out",
                str(tmp_path / dtype),
                "--dtype",
                dtype,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "float32").eval()
    assert {
        p.dtype for p in AutoModelForCausalLM.from_pretrained(tmp_path / "bfloat16", dtype="auto").parameters()
    } == {torch.bfloat16}
    trainer = AutoModelForCausalLM.from_pretrained(summary["model"]).eval()
    trainer.load_state_dict(load_model_weights(latest_checkpoint(run_dir / "trainer" / "checkpoints")))
    prompts = encode_prompts(char_tokenizer(), [e.prompt for e in TinySpec().task(9).split("eval", 20)])
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = trainer.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            got = exported.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)
    assert not torch.equal(
        exported.lm_head.weight, AutoModelForCausalLM.from_pretrained(summary["model"]).lm_head.weight
    )
