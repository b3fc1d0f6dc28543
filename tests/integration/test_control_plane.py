"""The orchestrator's HTTP control plane on a real redis-server: auth, transitions, status."""

import asyncio
import json

import httpx
import pytest
from redis.asyncio import Redis

from services.orchestrator.config import OrchestratorSettings
from services.orchestrator.orchestrator import Orchestrator
from services.orchestrator.server import create_app
from shared.runstore.queues import WorkQueue
from tests.helpers import read_scalars

TOKEN = "s3cret-token"


async def orchestrator_on(redis_url: str, run_id: str, model_dir, out_dir, state: str, **fields):
    """(a client, an Orchestrator) of `run_id` on a real Redis, the run put in `state`."""
    redis = Redis.from_url(redis_url)
    settings = OrchestratorSettings(
        model_path=str(model_dir), redis_url=redis_url, run_id=run_id, out_dir=out_dir, **fields, evals={"size": 5}
    )
    orchestrator = Orchestrator(settings, redis)
    await redis.hset(orchestrator.keys.run, "state", state)
    return redis, orchestrator


def test_auth_transitions_status_and_admission(redis_server, run_id, tiny_model_dir, tmp_path):
    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = run_settings(
            redis_server,
            run_id,
            tiny_model_dir,
            tmp_path,
            batch_prompts=2,
            group_size=2,
            steps=3,
            evals={"size": 5},
        )
        orchestrator = Orchestrator(settings, redis)
        await redis.hset(orchestrator.keys.run, "state", "created")
        transport = httpx.ASGITransport(app=create_app(orchestrator, TOKEN))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:

            async def call(method, path, token=TOKEN):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                return await http.request(method, path, headers=headers)

            assert (await call("GET", "/health", None)).status_code == 200
            assert (await call("GET", "/metrics", None)).status_code == 200
            for token in (None, "wrong"):
                reply = await call("GET", "/v1/run", token)
                assert reply.status_code == 401 and reply.json()["detail"] == "missing or wrong bearer token"
            assert (await call("POST", "/v1/run/resume")).status_code == 409  # not paused
            assert (await call("POST", "/v1/run/start")).json()["state"] == "running"
            assert (await call("POST", "/v1/run/start")).status_code == 409
            assert (await call("POST", "/v1/run/pause")).json()["state"] == "paused"
            assert (await call("POST", "/v1/run/resume")).json()["state"] == "running"
            assert (await call("POST", "/v1/run/explode")).status_code == 404
            status = (await call("GET", "/v1/run")).json()
            assert status["state"] == "running" and status["queue"]["pending"] == 0
            config = (await call("GET", "/v1/run/config")).json()
            assert config["batch_prompts"] == 2 and "token" not in config and "redis_url" not in config
            # (max_staleness 1 + 1) × B prompts for version 0, and lookahead_batches 1 × B for version 1
            assert await orchestrator.admit() == 6
            assert await orchestrator.admit() == 0  # the budget is spent until the trainer moves
            assert (await call("GET", "/v1/run")).json()["queue"]["pending"] == 6
            leases = await WorkQueue(redis, run_id).lease("replica-0", 60, count=6)
            assert [lease.task.min_policy_version for lease in leases] == [0, 0, 0, 0, 1, 1]
        await orchestrator.close()
        await redis.aclose()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_tasks_dropped_ahead_are_replaced_by_tasks_the_trainer_can_use(redis_server, run_id, tiny_model_dir, tmp_path):
    """B = 2, max_staleness 1, lookahead 2: 8 tasks ask for versions 0,0,0,0,1,1,2,2. The four for
    version 0 dropped (a restarted trainer's stale rollouts), their replacements ask for version 0
    (by position they would ask for 1,1,2,2, and a trainer at version 0 would wait for ever); a
    restarted orchestrator reads what it queued ahead from Redis."""

    async def main():
        fields = {"batch_prompts": 2, "group_size": 2, "max_staleness": 1, "lookahead_batches": 2, "steps": 10}
        redis, orchestrator = await orchestrator_on(
            redis_server.url, run_id, tiny_model_dir, tmp_path, "running", **fields
        )
        queue = WorkQueue(redis, run_id)

        async def admitted():
            return {lease.task_id: lease.task.min_policy_version for lease in await queue.lease("r", 60, count=16)}

        async def drop(task_ids):  # as the trainer records a group dropped as stale: each rollout's id
            await redis.rpush(orchestrator.keys.dropped, *[f"{t}:{i}" for t in task_ids for i in range(2)])

        assert await orchestrator.admit() == 8
        first = await admitted()
        assert list(first.values()) == [0, 0, 0, 0, 1, 1, 2, 2]
        await drop([t for t, v in first.items() if v == 0])
        assert await orchestrator.admit() == 4
        second = await admitted()
        assert set(second) == {f"train-{i}" for i in range(8, 12)} and set(second.values()) == {0}
        assert json.loads(await redis.hget(orchestrator.keys.run, "ahead")) == {"1": 2, "2": 2}
        await orchestrator.close()
        restarted = Orchestrator(orchestrator.settings, redis)
        await drop(list(second))
        assert await restarted.admit() == 4
        assert set((await admitted()).values()) == {0}
        await restarted.close()
        await redis.aclose()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_stop_is_final_even_when_sent_together_with_pauses(redis_server, run_id, tiny_model_dir, tmp_path):
    import random

    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = run_settings(
            redis_server,
            run_id,
            tiny_model_dir,
            tmp_path,
            evals={"size": 5},
        )
        orchestrator = Orchestrator(settings, redis)
        transport = httpx.ASGITransport(app=create_app(orchestrator, TOKEN))
        outcomes = []
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as http:
            for attempt in range(20):
                await redis.hset(orchestrator.keys.run, "state", "running")
                actions = ["stop", "pause", "pause", "pause"]
                random.Random(attempt).shuffle(actions)
                replies = await asyncio.gather(*(http.post(f"/v1/run/{a}") for a in actions))
                stop = replies[actions.index("stop")]
                resumed = await http.post("/v1/run/resume")  # a resume after a stop must not restart the run
                started = await http.post("/v1/run/start")
                outcomes.append(
                    (
                        stop.status_code,
                        stop.json()["state"],
                        resumed.status_code,
                        started.status_code,
                        await orchestrator.state(),
                    )
                )
            docs = {
                path: (await http.get(path, headers={"Authorization": ""})).status_code
                for path in ("/openapi.json", "/docs", "/redoc")
            }
            openapi = await http.get("/openapi.json")
        await orchestrator.close()
        await redis.aclose()
        return outcomes, docs, openapi

    outcomes, docs, openapi = asyncio.run(asyncio.wait_for(main(), 60))
    assert outcomes == [(200, "stopped", 409, 409, "stopped")] * 20
    assert docs == {"/openapi.json": 401, "/docs": 401, "/redoc": 401}  # the API's description needs the token
    assert openapi.status_code == 200 and "/v1/run/{action}" in openapi.json()["paths"]


def test_training_waits_for_the_cold_start_eval(redis_server, run_id, tiny_model_dir, tmp_path):
    """Versions landing while the step-0 eval generates would be scored as version 0: no train task
    is queued until that round is in."""
    import numpy as np

    from shared.rollouts.record import Rollout, encode_rollout

    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = run_settings(
            redis_server,
            run_id,
            tiny_model_dir,
            tmp_path,
            batch_prompts=2,
            group_size=2,
            steps=3,
            evals={"every": 2, "size": 5},
        )
        orchestrator = Orchestrator(settings, redis)
        await redis.hset(orchestrator.keys.run, "state", "running")
        await orchestrator.tick()
        await orchestrator.tick()
        pending = sorted(t.decode() for t in await redis.lrange(orchestrator.keys.pending, 0, -1))
        assert pending == [f"eval-0-{j}" for j in range(5)]
        for j in range(5):
            rollout = Rollout(
                rollout_id=f"eval-0-{j}:0",
                group_id=f"eval-0-{j}",
                task_id=f"eval-0-{j}",
                run_id=run_id,
                sample_index=0,
                group_size=1,
                prompt_token_ids=np.array([1, 5], dtype=np.int32),
                completion_token_ids=np.array([7, 2], dtype=np.int32),
                inference_logprobs=np.array([-0.5, -0.1], np.float32),
                policy_versions=np.array([0, 0], dtype=np.uint64),
                reward=float(j < 2),
                is_eval=True,
            )
            await redis.xadd(orchestrator.keys.evals, {"task": f"eval-0-{j}", "n": "1", "r": encode_rollout(rollout)})
        await orchestrator.tick()
        pending = [t.decode() for t in await redis.lrange(orchestrator.keys.pending, 0, -1)]
        await orchestrator.close()
        await redis.aclose()
        return pending

    pending = asyncio.run(asyncio.wait_for(main(), 60))
    assert sum(t.startswith("train-") for t in pending) == 6  # admitted once the round is in (2 B and one lookahead B)
    first = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()][0]
    assert first["step"] == 0 and first["accuracy"] == 0.4 and first["policy_version_max"] == 0


def run_settings(redis_server, run_id: str, model_dir, out_dir, **fields) -> OrchestratorSettings:
    """An orchestrator's settings for one test's run: its Redis, run id, model and records, and `fields`."""
    return OrchestratorSettings(
        model_path=str(model_dir), redis_url=redis_server.url, run_id=run_id, out_dir=out_dir, **fields
    )


def eval_rollout(run_id: str, task: str, index: int, group: int, reward: float) -> bytes:
    import numpy as np

    from shared.rollouts.record import Rollout, encode_rollout

    return encode_rollout(
        Rollout(
            rollout_id=f"{task}:{index}",
            group_id=task,
            task_id=task,
            run_id=run_id,
            sample_index=index,
            group_size=group,
            prompt_token_ids=np.array([1, 5], dtype=np.int32),
            completion_token_ids=np.array([7, 2], dtype=np.int32),
            inference_logprobs=np.array([-0.5, -0.1], np.float32),
            policy_versions=np.array([0, 0], dtype=np.uint64),
            reward=reward,
            is_eval=True,
        )
    )


async def running_orchestrator(redis, settings: OrchestratorSettings):
    """An orchestrator in state running after one tick, and the tasks that tick queued (id → task)."""
    from shared.rpc.steadyrl.v1 import common_pb2

    orchestrator = Orchestrator(settings, redis)
    await redis.hset(orchestrator.keys.run, "state", "running")
    await orchestrator.tick()
    tasks = {}
    for task_id in await redis.lrange(orchestrator.keys.pending, 0, -1):
        tasks[task_id.decode()] = common_pb2.PromptTask.FromString(await redis.hget(orchestrator.keys.tasks, task_id))
    return orchestrator, tasks


def test_sampled_evals_report_pass_and_mean_at_k(redis_server, run_id, tiny_model_dir, tmp_path):
    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = run_settings(
            redis_server,
            run_id,
            tiny_model_dir,
            tmp_path,
            batch_prompts=2,
            group_size=2,
            steps=3,
            evals={"every": 2, "size": 3, "samples": 4, "temperature": 0.8},
        )
        orchestrator, tasks = await running_orchestrator(redis, settings)
        queued = {i: (t.group_size, round(t.sampling.temperature, 3)) for i, t in tasks.items()}
        correct = {0: [1, 0, 0, 0], 1: [1, 1, 1, 1], 2: [0, 0, 0, 0]}  # samples right per eval prompt
        for j in range(3):
            await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, f"eval-0-{j}", 0, 1, float(j == 1))})
            for i, reward in enumerate(correct[j]):
                await redis.xadd(
                    orchestrator.keys.evals, {"r": eval_rollout(run_id, f"evalk-0-{j}", i, 4, float(reward))}
                )
        await orchestrator.tick()
        await orchestrator.close()
        await redis.aclose()
        return queued

    queued = asyncio.run(asyncio.wait_for(main(), 60))
    assert queued == {**{f"eval-0-{j}": (1, 0.0) for j in range(3)}, **{f"evalk-0-{j}": (4, 0.8) for j in range(3)}}
    line = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[0])
    assert line["accuracy"] == pytest.approx(1 / 3) and line["k"] == 4
    assert line["pass_at_k"] == pytest.approx(2 / 3) and line["mean_at_k"] == pytest.approx(5 / 12)


def test_named_eval_sets_are_scored_apart(redis_server, run_id, tiny_model_dir, tmp_path):
    """Two eval sets: the task's own (`main`, 3 prompts) and `hard` from a JSONL file (2 prompts).
    A round is written once both sets are in, each set's accuracy apart (eval.jsonl, TensorBoard,
    the Prometheus gauge per set)."""
    from prometheus_client import REGISTRY

    from shared.models import load_tokenizer
    from shared.models.loading import encode_prompt

    hard = tmp_path / "hard.jsonl"
    hard.write_text('{"q": "98+99=", "a": "791"}\n{"q": "77+88=", "a": "561"}\n{"q": "11+11=", "a": "22"}\n')

    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = OrchestratorSettings(
            model_path=str(tiny_model_dir),
            redis_url=redis_server.url,
            run_id=run_id,
            out_dir=tmp_path / "orch",
            batch_prompts=2,
            group_size=2,
            steps=3,
            evals={"every": 2, "size": 2, "sets": {"hard": hard}},
            data={"prompt_column": "q", "answer_column": "a"},
        )
        orchestrator, tasks = await running_orchestrator(redis, settings)
        queued = {i: (list(t.prompt_token_ids), t.answer) for i, t in tasks.items()}
        for j in range(2):
            await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, f"eval-0-{j}", 0, 1, 1.0)})
        await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, "eval.hard-0-0", 0, 1, 1.0)})
        await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, "eval.hard-0-7", 0, 1, 1.0)})  # no such
        await orchestrator.tick()
        before = (settings.out_dir / "eval.jsonl").exists()
        await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, "eval.hard-0-1", 0, 1, 0.0)})
        await orchestrator.tick()
        await orchestrator.close()
        await redis.aclose()
        return queued, before

    refused = (
        REGISTRY.get_sample_value("steadyrl_orchestrator_eval_rollouts_refused_total", {"reason": "unknown_eval_task"})
        or 0.0
    )
    queued, written_before_hard = asyncio.run(asyncio.wait_for(main(), 60))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert queued["eval.hard-0-0"] == (encode_prompt(tokenizer, "98+99="), "791")  # the prompt as written
    assert queued["eval.hard-0-1"][1] == "561" and "eval.hard-0-2" not in queued  # eval_size caps each set
    assert sum(t.startswith("eval-0-") for t in queued) == 2
    assert not written_before_hard  # main complete, hard half in: no line yet
    line = json.loads((tmp_path / "orch" / "eval.jsonl").read_text().splitlines()[0])
    assert line["accuracy"] == 1.0 and line["prompts"] == 2
    assert line["sets"] == {"main": {"accuracy": 1.0, "prompts": 2}, "hard": {"accuracy": 0.5, "prompts": 2}}
    scalars = read_scalars(tmp_path / "orch" / "tensorboard")
    assert scalars["eval_accuracy"] == [(0, 1.0)] and scalars["eval_set/hard/accuracy"] == [(0, 0.5)]
    assert REGISTRY.get_sample_value("steadyrl_orchestrator_eval_accuracy", {"set": "hard"}) == 0.5
    assert (
        REGISTRY.get_sample_value("steadyrl_orchestrator_eval_rollouts_refused_total", {"reason": "unknown_eval_task"})
        == refused + 1
    )


def test_eval_sets_are_checked_before_start(tmp_path, tiny_model_dir):
    hard = tmp_path / "hard.jsonl"
    hard.write_text('{"problem": "1+1=", "answer": "2"}\n')
    base = {"model_path": str(tiny_model_dir), "out_dir": tmp_path}
    with pytest.raises(ValueError, match="eval set name 'Hard!'"):
        OrchestratorSettings(**base, evals={"sets": {"Hard!": hard}})
    with pytest.raises(ValueError, match="not 'main'"):
        OrchestratorSettings(**base, evals={"sets": {"main": hard}})
    with pytest.raises(ValueError, match="does not exist"):
        OrchestratorSettings(**base, evals={"sets": {"gone": tmp_path / "gone.jsonl"}}).check_dataset()
    with pytest.raises(ValueError, match="no answer column 'solution'"):
        OrchestratorSettings(**base, evals={"sets": {"hard": hard}}, data={"answer_column": "solution"}).check_dataset()
    OrchestratorSettings(**base, evals={"sets": {"hard": hard}}).check_dataset()  # columns found: fine


def test_policy_evals_go_to_their_pool_and_are_scored_apart(redis_server, run_id, tiny_model_dir, tmp_path):
    """With policy_eval each round also queues π's greedy tasks (evalpi-…) in the policy_eval pool's
    list, which only a policy_eval queue leases. Training waits for both step-0 rounds; π's round is
    written to policy-eval.jsonl, its gauge and its first round's (kept in the run hash, exported again
    by a restarted orchestrator); an orchestrator without policy_eval refuses π's rollouts."""
    from prometheus_client import REGISTRY

    from services.orchestrator.evals import POLICY_EVAL_INITIAL
    from shared.runstore.queues import WorkQueue

    def gauge(name: str) -> float | None:
        return REGISTRY.get_sample_value(f"steadyrl_orchestrator_{name}", {"set": "main"})

    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = run_settings(
            redis_server,
            run_id,
            tiny_model_dir,
            tmp_path,
            batch_prompts=2,
            group_size=2,
            steps=3,
            evals={"every": 2, "size": 3, "policy": True},
        )
        orchestrator, tasks = await running_orchestrator(redis, settings)
        policy_pending = sorted(t.decode() for t in await redis.lrange(orchestrator.keys.pending_policy, 0, -1))
        assert (await orchestrator.status())["queue"]["pending_policy"] == 3
        mu = [lease.task_id for lease in await WorkQueue(redis, run_id).lease("r0", 30, 10)]
        pi = await WorkQueue(redis, run_id, pool="policy_eval").lease("p0", 30, 10)
        pi_task = (pi[0].task.group_size, pi[0].task.sampling.temperature, pi[0].task.min_policy_version)
        for j in range(3):
            await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, f"eval-0-{j}", 0, 1, float(j == 0))})
        await orchestrator.tick()
        admitted_before_pi = await redis.llen(orchestrator.keys.pending)
        for j in range(3):
            await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, f"evalpi-0-{j}", 0, 1, float(j > 0))})
        await orchestrator.tick()
        admitted = [t.decode() for t in await redis.lrange(orchestrator.keys.pending, 0, -1)]
        status = await orchestrator.status()
        await orchestrator.close()
        POLICY_EVAL_INITIAL.labels("main").set(-1)
        restarted = Orchestrator(settings, redis)
        await restarted.evals.restore()
        restored = gauge("policy_eval_initial_accuracy")
        await restarted.close()
        refused = (
            REGISTRY.get_sample_value(
                "steadyrl_orchestrator_eval_rollouts_refused_total", {"reason": "unknown_eval_task"}
            )
            or 0.0
        )
        without = Orchestrator(
            settings.model_copy(
                update={"evals": settings.evals.model_copy(update={"policy": False}), "out_dir": tmp_path / "without"}
            ),
            redis,
        )
        await without.evals.collect()
        refused = (
            REGISTRY.get_sample_value(
                "steadyrl_orchestrator_eval_rollouts_refused_total", {"reason": "unknown_eval_task"}
            )
            or 0.0
        ) - refused
        await without.close()
        await redis.aclose()
        return (
            sorted(tasks),
            policy_pending,
            sorted(mu),
            sorted(lease.task_id for lease in pi),
            pi_task,
            admitted_before_pi,
            admitted,
            status,
            restored,
            refused,
        )

    queued, policy_pending, mu, pi, pi_task, admitted_before_pi, admitted, status, restored, refused = asyncio.run(
        asyncio.wait_for(main(), 60)
    )
    assert queued == [f"eval-0-{j}" for j in range(3)]  # the rollouts pool's list holds μ's round only
    assert policy_pending == pi == [f"evalpi-0-{j}" for j in range(3)]
    assert mu == queued  # a rollouts queue never leases π's tasks
    assert pi_task == (1, 0.0, 0)  # greedy, one sample, version 0
    assert admitted_before_pi == 0  # μ's round in, π's not: no train task yet
    assert sum(t.startswith("train-") for t in admitted) == 6  # 2 B and one lookahead B
    mu_line = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[0])
    pi_lines = [json.loads(line) for line in (tmp_path / "policy-eval.jsonl").read_text().splitlines()]
    assert mu_line["accuracy"] == pytest.approx(1 / 3)
    assert len(pi_lines) == 1 and pi_lines[0]["step"] == 0 and pi_lines[0]["accuracy"] == pytest.approx(2 / 3)
    assert pi_lines[0]["prompts"] == 3 and "k" not in pi_lines[0]
    assert gauge("policy_eval_accuracy") == pytest.approx(2 / 3) and gauge("eval_accuracy") == pytest.approx(1 / 3)
    assert restored == pytest.approx(2 / 3)  # from the run hash, after the gauge was overwritten
    assert status["policy_evals"] == {"0": pytest.approx(2 / 3)} and status["evals"] == {"0": pytest.approx(1 / 3)}
    assert status["queue"]["pending_policy"] == 0  # π's round taken and answered
    assert read_scalars(tmp_path / "tensorboard")["policy_eval_accuracy"] == [(0, pytest.approx(2 / 3))]
    assert refused == 3  # π's three rollouts fit no round of a run without policy_eval


def test_pi_s_gauges_hold_its_first_round_and_its_two_latest_by_step(redis_server, run_id, tiny_model_dir, tmp_path):
    """SteadyrlPolicyUnderStart compares π's first round with its last and the one before: the gauges
    follow the two latest rounds by step (a round written late does not become the last), a set with
    no answered prompt keeps its previous values, and a restarted orchestrator exports all three again."""
    from prometheus_client import REGISTRY

    from services.orchestrator.evals import (
        POLICY_EVAL_ACCURACY,
        POLICY_EVAL_INITIAL,
        POLICY_EVAL_PREVIOUS,
    )

    def gauges(name: str) -> tuple:
        return tuple(
            REGISTRY.get_sample_value(f"steadyrl_orchestrator_policy_eval_{kind}accuracy", {"set": name})
            for kind in ("initial_", "", "previous_")
        )

    def round_of(main: float, hard: float | None) -> dict:
        return {
            "main": {"accuracy": main, "prompts": 4},
            "hard": {"accuracy": hard or 0.0, "prompts": 4 if hard is not None else 0},
        }

    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = run_settings(
            redis_server,
            run_id,
            tiny_model_dir,
            tmp_path,
            evals={"every": 2, "policy": True},
        )
        orchestrator = Orchestrator(settings, redis)
        seen = []
        for step, main_accuracy, hard in ((0, 0.5, 0.25), (4, 0.3, 0.125), (2, 0.45, 0.2), (6, 0.35, None)):
            await orchestrator.evals._keep_policy_round(step, round_of(main_accuracy, hard))
            seen.append((gauges("main"), gauges("hard")))
        await orchestrator.close()
        for gauge in (POLICY_EVAL_INITIAL, POLICY_EVAL_ACCURACY, POLICY_EVAL_PREVIOUS):
            gauge.labels("main").set(-1)
        restarted = Orchestrator(settings, redis)
        await restarted.evals.restore()
        restored = gauges("main")
        await restarted.close()
        await redis.aclose()
        return seen, restored

    seen, restored = asyncio.run(asyncio.wait_for(main(), 60))
    assert seen[0] == ((0.5, 0.5, None), (0.25, 0.25, None))  # one round: no previous yet
    assert seen[1] == ((0.5, 0.3, 0.5), (0.25, 0.125, 0.25))
    assert seen[2] == ((0.5, 0.3, 0.45), (0.25, 0.125, 0.2))  # step 2 written after 4: the one before the last
    assert seen[3] == ((0.5, 0.35, 0.3), (0.25, 0.125, 0.2))  # hard had no answer at step 6: kept as it was
    assert restored == (0.5, 0.35, 0.3)


def test_an_eval_task_given_up_completes_its_round_as_dead(redis_server, run_id, tiny_model_dir, tmp_path):
    """An eval task dead-lettered (μ's greedy and sampled, π's) never holds its round, nor the run's
    end: the round is written with the prompts that were answered and the given-up ones under `dead`,
    by this orchestrator and, reading the dead-letter stream from its start, by a restarted one."""
    from shared.runstore.queues import WorkQueue

    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = run_settings(
            redis_server,
            run_id,
            tiny_model_dir,
            tmp_path,
            batch_prompts=2,
            group_size=2,
            steps=3,
            evals={"every": 2, "size": 3, "samples": 2, "policy": True},
        )
        orchestrator, _ = await running_orchestrator(redis, settings)
        queue = WorkQueue(redis, run_id)
        policy = WorkQueue(redis, run_id, pool="policy_eval")
        await queue.lease("r0", 30, 10)
        await policy.lease("p0", 30, 10)
        for task in ("eval-0-2", "evalk-0-2"):
            assert await queue.dead_letter("r0", task, "invalid", "a task the engine refuses")
        assert await policy.dead_letter("p0", "evalpi-0-2", "invalid", "a task the engine refuses")
        for j in range(2):
            await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, f"eval-0-{j}", 0, 1, float(j == 0))})
            await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, f"evalpi-0-{j}", 0, 1, 1.0)})
            for i in range(2):
                await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, f"evalk-0-{j}", i, 2, 1.0)})
        await orchestrator.tick()
        baseline = await orchestrator.evals.baseline_written()
        await orchestrator.close()
        restarted = Orchestrator(settings.model_copy(update={"out_dir": tmp_path / "again"}), redis)
        await redis.hset(restarted.keys.run, mapping={"evals_written": "[]", "policy_evals_written": "[]"})
        await restarted.evals.collect()  # both streams from their start, as after a restart
        again = await restarted.evals.baseline_written()
        await restarted.close()
        await redis.aclose()
        return baseline, again

    baseline, again = asyncio.run(asyncio.wait_for(main(), 60))
    assert baseline and again
    for out in (tmp_path, tmp_path / "again"):
        mu = json.loads((out / "eval.jsonl").read_text().splitlines()[0])
        pi = json.loads((out / "policy-eval.jsonl").read_text().splitlines()[0])
        assert (mu["accuracy"], mu["prompts"], mu["dead"], mu["k"], mu["pass_at_k"]) == (0.5, 2, 2, 2, 1.0)
        assert (pi["accuracy"], pi["prompts"], pi["dead"]) == (1.0, 2, 1)


MIXTURE = {"mixture": [{"name": "add", "task": "arith", "weight": 3}, {"name": "trace", "task": "mul_trace"}]}


@pytest.mark.parametrize("data", [{}, MIXTURE], ids=["one_source", "mixture"])
def test_train_tasks_redis_lost_whole_are_queued_again_and_no_other(
    redis_server, run_id, tiny_model_dir, tmp_path, data
):
    """A host crash can bring Redis back holding a submitted task in no state at all: the sweep after
    a restart queues exactly those again (not queued, leased, completed, trained, dropped or dead ones),
    each the same task, of the same source."""
    from shared.rpc.steadyrl.v1.common_pb2 import PromptTask
    from shared.runstore.queues import WorkQueue

    async def main():
        redis, orchestrator = await orchestrator_on(
            redis_server.url,
            run_id,
            tiny_model_dir,
            tmp_path,
            "running",
            batch_prompts=4,
            group_size=2,
            steps=10,
            lookahead_batches=0,
            data=data,
        )
        assert await orchestrator.admit() == 8  # train-0 .. train-7
        keys = orchestrator.keys
        stored = {k.decode(): PromptTask.FromString(v).source for k, v in (await redis.hgetall(keys.tasks)).items()}
        mixed = {f"train-{i}": "trace" if i % 4 == 2 else "add" for i in range(8)}  # 3:1 — add add trace add
        assert stored == (mixed if data else dict.fromkeys(mixed, ""))
        queue = WorkQueue(redis, run_id)
        [leased, completed, dead, lost_a, trained, dropped] = await queue.lease("replica-0", 60, count=6)
        assert await queue.complete("replica-0", completed.task_id, [b"r0", b"r1"])
        assert await queue.dead_letter("replica-0", dead.task_id, "invalid", "test")
        for lease in (lost_a, trained, dropped):  # then Redis loses them whole...
            await redis.hdel(keys.tasks, lease.task_id)
            await redis.zrem(keys.leases, lease.task_id)
            await redis.hdel(keys.owners, lease.task_id)
        await redis.sadd(keys.trained_ids, f"{trained.task_id}:0", f"{trained.task_id}:1")  # ...but the
        await redis.sadd(keys.trained_ids, f"{dropped.task_id}:0", f"{dropped.task_id}:1")  # ledger holds two
        lost_b = (await redis.rpop(keys.pending)).decode()  # a queued one lost too
        await redis.hdel(keys.tasks, lost_b)
        before = await redis.llen(keys.pending)
        assert await orchestrator.recovery.requeue_lost() == 2
        pending = [x.decode() for x in await redis.lrange(keys.pending, 0, -1)]
        assert len(pending) == before + 2 and {lost_a.task_id, lost_b} <= set(pending)
        assert leased.task_id not in pending and completed.task_id not in pending
        assert await orchestrator.recovery.requeue_lost() == 0  # queued now: found
        [again] = [x for x in await queue.lease("replica-1", 60, count=8) if x.task_id == lost_a.task_id]
        assert list(again.task.prompt_token_ids) == list(lost_a.task.prompt_token_ids)  # the same prompt
        assert (again.task.source, again.task.answer) == (lost_a.task.source, lost_a.task.answer)
        await orchestrator.close()
        await redis.aclose()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_eval_rounds_are_written_in_step_order_whichever_completes_first(
    redis_server, run_id, tiny_model_dir, tmp_path
):
    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = run_settings(
            redis_server,
            run_id,
            tiny_model_dir,
            tmp_path,
            batch_prompts=2,
            group_size=2,
            steps=4,
            evals={"every": 2, "size": 2},
        )
        orchestrator, _ = await running_orchestrator(redis, settings)
        await orchestrator.evals.schedule(2, 2)  # the rounds of steps 0 and 2 queued
        for j in range(2):  # step 2's round completes first ...
            await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, f"eval-2-{j}", 0, 1, 1.0)})
        await orchestrator.evals.collect()
        early = (tmp_path / "eval.jsonl").read_text().splitlines() if (tmp_path / "eval.jsonl").exists() else []
        for j in range(2):  # ... then step 0's
            await redis.xadd(orchestrator.keys.evals, {"r": eval_rollout(run_id, f"eval-0-{j}", 0, 1, float(j))})
        await orchestrator.evals.collect()
        await orchestrator.close()
        await redis.aclose()
        return early

    early = asyncio.run(asyncio.wait_for(main(), 60))
    assert early == []  # step 2's round waited for step 0's
    lines = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 2] and [x["accuracy"] for x in lines] == [0.5, 1.0]
