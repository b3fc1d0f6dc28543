"""A teacher pool for real: two teacher replicas (`python -m services.inference`, pool `teacher`) on the
tiny model, reached through `PoolClient` — Score equals the engine's own logprobs, a dead address and
a frozen replica (SIGSTOP) cost one bounded attempt each and the next replica answers, garbage and
invalid requests fail with their reason, and the replica counts what it served."""

import asyncio
import logging
import os
import signal
import urllib.request

import pytest

from bench.faults import teacher_replica, wait_serving
from shared.engines import make_engine
from shared.rpc.pool_client import PoolClient, PoolError
from shared.rpc.steadyrl.v1 import inference_pb2 as pb
from shared.rpc.steadyrl.v1 import inference_pb2_grpc
from shared.runstore.redis_server import free_port


def test_a_teacher_pool_scores_and_survives_a_dead_and_a_frozen_replica(tiny_model_dir, monkeypatch, caplog):
    """Outcomes only: how long a frozen replica's attempt takes is bench/faults.py's."""
    monkeypatch.delenv("STEADYRL_TOKEN", raising=False)
    ports = [free_port() for _ in range(5)]
    dead, (a, a_metrics), (b, b_metrics) = ports[0], ports[1:3], ports[3:5]
    replicas = [
        teacher_replica(tiny_model_dir, a, "teacher-0", a_metrics),
        teacher_replica(tiny_model_dir, b, "teacher-1", b_metrics),
    ]
    prompt, completion = [1, 5, 6, 7], [4, 5, 7, 7, 6, 5]
    engine = make_engine("torch", str(tiny_model_dir), "float32")
    [expected] = engine.score([(prompt, completion)], top_k=3)
    engine.close()
    request = pb.ScoreRequest(
        sequences=[pb.ScoreSequence(prompt_token_ids=prompt, completion_token_ids=completion)], top_k=3
    )
    try:
        wait_serving(a)
        wait_serving(b)

        async def main():
            client = PoolClient(
                "teacher",
                [f"127.0.0.1:{dead}", f"127.0.0.1:{a}", f"127.0.0.1:{b}"],
                inference_pb2_grpc.InferenceStub,
                timeout_seconds=2.0,
                attempts=3,
                backoff_seconds=0.05,
            )
            out = {}
            out["first"] = await client.call("Score", request)  # the dead address, then teacher-0
            os.kill(replicas[0].pid, signal.SIGSTOP)  # frozen: its attempt runs out, teacher-1 answers
            try:
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="steadyrl.pools"):
                    out["frozen"] = await client.call("Score", request)  # teacher-1 first (round robin), then dead
                    out["frozen_again"] = await client.call("Score", request)  # ... teacher-0 frozen, teacher-1
                out["failed"] = [r.getMessage() for r in caplog.records if "event=pool_call_failed" in r.getMessage()]
            finally:
                os.kill(replicas[0].pid, signal.SIGCONT)
            with pytest.raises(PoolError, match="3 attempts failed, the last: .*garbage"):
                await client.call("Score", request, check=lambda reply: "garbage")
            bad = pb.ScoreRequest(sequences=[pb.ScoreSequence(prompt_token_ids=[1, 999], completion_token_ids=[2])])
            with pytest.raises(PoolError, match="INVALID_ARGUMENT .*vocabulary") as refused:
                await client.call("Score", bad)  # not retried: no replica would score it
            out["invalid"] = refused.value.reason
            too_many = pb.ScoreRequest(sequences=request.sequences, top_k=21)
            with pytest.raises(PoolError, match=r"INVALID_ARGUMENT .*top_k 21 is outside \[0, 20\]"):
                await client.call("Score", too_many)
            await client.close()
            return out

        out = asyncio.run(asyncio.wait_for(main(), 120))
        served = {name: served_by(port) for name, port in (("teacher-0", a_metrics), ("teacher-1", b_metrics))}
    finally:
        for replica in replicas:
            replica.terminate()
            replica.wait(20)
    for key in ("first", "frozen", "frozen_again"):
        scored = out[key].sequences[0]
        assert list(scored.logprobs) == pytest.approx(expected.logprobs, abs=1e-5), key
        assert list(scored.top_token_ids) == [t for row in expected.top_ids for t in row], key
        assert list(scored.top_logprobs) == pytest.approx([x for row in expected.top_logprobs for x in row], abs=1e-5)
    assert len(expected.top_ids) == len(completion) and all(len(row) == 3 for row in expected.top_ids)
    # the frozen replica's attempt ended at its deadline (not a hang), the dead address's at once; the
    # next replica answered each call
    reasons = [line.split("reason=", 1)[1] for line in out["failed"]]
    assert any(r.startswith(f"127.0.0.1:{a}: DEADLINE_EXCEEDED") for r in reasons), reasons
    assert all(r.startswith((f"127.0.0.1:{a}: DEADLINE_EXCEEDED", f"127.0.0.1:{dead}: UNAVAILABLE")) for r in reasons)
    assert served["teacher-0"] >= 1 and served["teacher-1"] >= 2 and sum(served.values()) >= 5, served


def served_by(metrics_port: int) -> float:
    """Score requests a replica answered (its Prometheus counter)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("steadyrl_pool_requests_total{") and 'method="Score"' in line
    )


def test_a_teacher_s_score_of_its_own_samples_equals_their_sampling_logprobs(tiny_model_dir):
    """The prefill that scores for a teacher aligns each logprob with its token: a model scoring its own
    samples gives back the logprobs it sampled them with (fp32, temperature 1); its top-k at each
    position is the distribution's head, most likely first, and holds the sampled token's logprob
    wherever the token is in it."""
    from shared.engines import Sampling
    from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts

    engine = make_engine("torch", str(tiny_model_dir), "float32")
    try:
        prompts = encode_prompts(char_tokenizer(), [e.prompt for e in TinySpec().task().split("train", 6)])
        samples = engine.generate(prompts, Sampling(temperature=1.0, max_new_tokens=6, seed=3))
        scored = engine.score([(p, s.token_ids) for p, s in zip(prompts, samples, strict=True)], top_k=4)
    finally:
        engine.close()
    assert sum(len(s.token_ids) for s in samples) >= 12
    found = 0
    for sample, row in zip(samples, scored, strict=True):
        assert row.logprobs == pytest.approx(sample.logprobs, abs=1e-5)
        for token, logprob, ids, tops in zip(
            sample.token_ids, row.logprobs, row.top_ids, row.top_logprobs, strict=True
        ):
            assert len(ids) == len(set(ids)) == 4 and tops == sorted(tops, reverse=True) and logprob <= tops[0] + 1e-6
            if token in ids:
                found += 1
                assert tops[ids.index(token)] == pytest.approx(logprob, abs=1e-5)
            else:
                assert logprob <= tops[-1] + 1e-6
    assert found >= 6  # sampled at temperature 1, most tokens are among the 4 most likely


def test_a_rollout_replica_leases_nothing_before_its_teacher_pool_answers(redis_server, run_id, tiny_model_dir):
    """A rollout replica whose teacher pool never comes up (nothing listens at its address) leases no
    task in `ready_seconds`, then ends with the reason; the queued task is still there, unleased."""
    from redis.asyncio import Redis

    from services.inference.config import InferenceSettings
    from services.inference.teacher import TeacherScoring
    from services.inference.worker import RolloutWorker
    from shared.models import load_tokenizer
    from shared.rpc.steadyrl.v1 import common_pb2
    from shared.runstore.queues import WorkQueue

    nobody = f"127.0.0.1:{free_port()}"
    engine = make_engine("torch", str(tiny_model_dir), "float32", threads=1)

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        await queue.submit_many([common_pb2.PromptTask(task_id="train-0", prompt_token_ids=[1, 2], group_size=2)])
        client = PoolClient("teacher", [nobody], inference_pb2_grpc.InferenceStub, 1.0, 1, ready_seconds=1.5)
        settings = InferenceSettings(
            model_path=str(tiny_model_dir),
            replica_id="r0",
            return_routing_traces=False,
            tasks={"lease_seconds": 30.0, "per_batch": 4, "idle_poll_seconds": 0.05},
        )
        worker = RolloutWorker(
            engine, load_tokenizer(str(tiny_model_dir)), queue, settings, teacher=TeacherScoring(client)
        )
        try:
            await worker.run(asyncio.Event())
        except PoolError as error:
            ended = str(error)
        else:
            ended = ""
        await client.close()
        leased = await queue.lease("r1", 30.0, count=4)
        await redis.aclose()
        return ended, [(lease.task_id, lease.attempt) for lease in leased]

    try:
        ended, leased = asyncio.run(main())
    finally:
        engine.close()
    assert ended == f"teacher pool: no replica of {nobody} answered within 1.5s", ended
    assert leased == [("train-0", 0)]  # never leased by the replica that waited: its first lease, here


def test_groups_that_finish_together_share_a_score_call(tiny_model_dir, monkeypatch):
    """Six groups attached at once through a real teacher replica: the first two calls go out at once
    (two in flight), the other four groups wait and go together in a third call; every group gets its
    own scores, equal to the engine's. With at most 2 sequences a call each group is its own call, and a
    pool that fails every attempt fails every waiting group with the reason."""
    import numpy as np

    from services.inference.teacher import TeacherScoring
    from shared.rollouts.record import Rollout, decode_rollout, encode_rollout

    monkeypatch.delenv("STEADYRL_TOKEN", raising=False)
    port, metrics_port, dead = free_port(), free_port(), free_port()
    replica = teacher_replica(tiny_model_dir, port, "teacher-0", metrics_port)
    rng = np.random.default_rng(5)
    groups = []
    for g in range(6):
        prompt = [1, *rng.integers(4, 20, size=4).tolist()]
        rollouts = [
            Rollout(
                f"r{g}-{i}",
                f"g{g}",
                np.array(prompt, np.int32),
                rng.integers(4, 20, size=3 + i).astype(np.int32),
                np.full(3 + i, -1.0, np.float32),
                np.zeros(3 + i, np.uint64),
                0.0,
                i,
                2,
            )
            for i in range(2)
        ]
        groups.append([encode_rollout(r) for r in rollouts])
    engine = make_engine("torch", str(tiny_model_dir), "float32")
    pairs = [
        (r.prompt_token_ids.tolist(), r.completion_token_ids.tolist()) for g in groups for r in map(decode_rollout, g)
    ]
    expected = engine.score(pairs, top_k=2)
    engine.close()

    def client(addresses):
        return PoolClient(
            "teacher",
            addresses,
            inference_pb2_grpc.InferenceStub,
            timeout_seconds=10.0,
            attempts=2,
            backoff_seconds=0.05,
        )

    try:
        wait_serving(port)

        async def main():
            out = {}
            for name, cap in (("batched", 256), ("capped", 2)):
                scoring = TeacherScoring(client([f"127.0.0.1:{port}"]), top_k=2, batch_sequences=cap)
                out[name] = await asyncio.gather(*(scoring.attach(g) for g in groups))
                out[name + "_calls"] = scoring.calls
                await scoring.client.close()
            failing = TeacherScoring(client([f"127.0.0.1:{dead}"]), top_k=2)
            out["failed"] = await asyncio.gather(*(failing.attach(g) for g in groups), return_exceptions=True)
            out["failed_calls"] = failing.calls
            await failing.client.close()
            return out

        out = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        replica.terminate()
        replica.wait(20)
    assert (out["batched_calls"], out["capped_calls"], out["failed_calls"]) == (3, 6, 3)
    for name in ("batched", "capped"):
        scored = [decode_rollout(p) for g in out[name] for p in g]
        assert [r.rollout_id for r in scored] == [f"r{g}-{i}" for g in range(6) for i in range(2)]
        for r, want in zip(scored, expected, strict=True):
            assert r.teacher_logprobs.tolist() == pytest.approx(want.logprobs, abs=1e-5)
            assert r.teacher_top_ids.tolist() == want.top_ids
    assert all(isinstance(e, PoolError) and "2 attempts failed" in str(e) for e in out["failed"])
