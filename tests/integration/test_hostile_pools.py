"""Teacher and judge replicas are not trusted: a hostile replica (tests/hostile_pool.py, a real gRPC
server) beside an honest one (`python -m services.inference` on the tiny model) costs a retried
attempt per call, never a value. Every hostile reply — scores of 1e39 and -3e38, "The answer is not
correct", an injection echoed beside a verdict, log-probs of -3e38, top-k ids past the vocabulary
or repeated — is counted as a failed attempt (`steadyrl_inference_pool_attempts_failed_total`), and
what the rollouts carry equals what the honest replica alone gives."""

import asyncio

import numpy as np
import pytest
from prometheus_client import REGISTRY

from bench.faults import teacher_replica, wait_serving
from services.inference.config import JudgeTemplate
from services.inference.judge import JudgeScoring
from services.inference.teacher import TeacherScoring
from shared.rollouts.record import Rollout, decode_rollout, encode_rollout
from shared.rpc.pool_client import PoolClient
from shared.rpc.steadyrl.v1 import inference_pb2_grpc
from shared.runstore.redis_server import free_port
from shared.tasks import RewardRunner
from tests.hostile_pool import JUDGE_REPLIES, SCORE_REPLIES, serve
from tests.integration.test_judge_pool import judge_replica

VOCAB = 64  # the tiny model's vocabulary


def failed(pool: str) -> dict[str, float]:
    out = {}
    for metric in REGISTRY.collect():
        if metric.name == "steadyrl_inference_pool_attempts_failed":
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels["pool"] == pool:
                    out[sample.labels["reason"]] = sample.value
    return out


def client(pool: str, addresses: list[str]) -> PoolClient:
    return PoolClient(pool, addresses, inference_pb2_grpc.InferenceStub, 20.0, 3, backoff_seconds=0.01)


def groups(count: int) -> list[list[bytes]]:
    rng = np.random.default_rng(0)
    out = []
    for g in range(count):
        prompt = [1, *rng.integers(4, 20, size=4).tolist()]
        out.append(
            [
                encode_rollout(
                    Rollout(
                        f"g{g}:{i}",
                        f"g{g}",
                        np.array(prompt, np.int32),
                        rng.integers(4, 20, size=4).astype(np.int32),
                        np.full(4, -1.0, np.float32),
                        np.zeros(4, np.uint64),
                        0.0,
                        i,
                        2,
                    )
                )
                for i in range(2)
            ]
        )
    return out


def test_a_hostile_judge_and_teacher_cost_attempts_never_values(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("STEADYRL_TOKEN", raising=False)
    judge_port, teacher_port, teacher_metrics = free_port(), free_port(), free_port()
    replicas = [
        judge_replica(tiny_model_dir, judge_port),
        teacher_replica(tiny_model_dir, teacher_port, "teacher-0", teacher_metrics),
    ]
    # the tiny policy as a judge: it reads a sum and writes its digits, read whole as a number
    template = JudgeTemplate(prompt="{prompt}{response}", rule="number", anchor="", markers=("", ""))
    prompts = [("", ["07+35=", "11+22=", "40+40=", "09+01="]), ("", ["12+34=", "50+25=", "33+33=", "10+90="])]
    work = groups(6)

    async def main():
        hostile_port = free_port()
        hostile = await serve(hostile_port, VOCAB)
        honest_judge, honest_teacher = f"127.0.0.1:{judge_port}", f"127.0.0.1:{teacher_port}"
        rewards = RewardRunner()
        out = {"before": (failed("judge"), failed("teacher"))}
        alone = JudgeScoring(client("judge", [honest_judge]), {"sum": template}, rewards)
        mixed = JudgeScoring(client("judge", [f"127.0.0.1:{hostile_port}", honest_judge]), {"sum": template}, rewards)
        out["judge_alone"] = [await alone.score("judge:sum", p, c, "42") for p, c in prompts * 5]
        out["judge_mixed"] = [await mixed.score("judge:sum", p, c, "42") for p, c in prompts * 5]
        plain = TeacherScoring(client("teacher", [honest_teacher]), top_k=2, batch_sequences=2, vocab_size=VOCAB)
        beside = TeacherScoring(
            client("teacher", [f"127.0.0.1:{hostile_port}", honest_teacher]),
            top_k=2,
            batch_sequences=2,
            vocab_size=VOCAB,
        )
        out["teacher_alone"] = [await plain.attach(g) for g in work]
        out["teacher_mixed"] = [await beside.attach(g) for g in work]
        out["after"] = (failed("judge"), failed("teacher"))
        out["answered"] = dict(hostile.answered)
        rewards.close()
        for scoring in (alone, mixed, plain, beside):
            await scoring.client.close()
        await hostile.server.stop(None)
        return out

    try:
        wait_serving(judge_port)
        wait_serving(teacher_port)
        out = asyncio.run(asyncio.wait_for(main(), 240))
    finally:
        for replica in replicas:
            replica.terminate()
            replica.wait(20)

    assert out["judge_mixed"] == out["judge_alone"]  # every reward the honest judge's
    assert all(s.value < 1e4 and not s.reason for scores, _ in out["judge_alone"] for s in scores)
    for alone, mixed in zip(out["teacher_alone"], out["teacher_mixed"], strict=True):
        for a, b in zip(map(decode_rollout, alone), map(decode_rollout, mixed), strict=True):
            assert np.array_equal(a.teacher_logprobs, b.teacher_logprobs)
            assert np.array_equal(a.teacher_top_ids, b.teacher_top_ids)
            assert a.teacher_logprobs.min() > -1e4 and a.teacher_top_ids.max() < VOCAB
    (judge_before, teacher_before), (judge_after, teacher_after) = out["before"], out["after"]

    def grew(before, after):
        return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}

    # the round robin starts every other call on the hostile replica: each of its replies failed
    assert out["answered"] == {"Judge": 5, "Score": 3}
    assert sum(grew(judge_before, judge_after).values()) == 5
    assert set(grew(judge_before, judge_after)) == {"out_of_range", "score_not_text", "unparsed"}
    assert sum(grew(teacher_before, teacher_after).values()) == 3
    assert grew(teacher_before, teacher_after) == {"logprob_range": 1, "top_k_ids": 2}
    assert len(JUDGE_REPLIES) == 5 and len(SCORE_REPLIES) == 3


@pytest.mark.parametrize("verdict", ["VERDICT: 1e39", "VERDICT: -3e38", "VERDICT: 10001"])
def test_a_verdict_past_the_template_s_range_is_never_a_reward(verdict):
    from services.inference.judge import reply_problem
    from shared.rpc.steadyrl.v1 import inference_pb2 as pb

    template = JudgeTemplate(prompt="{response}", rule="number")
    reply = pb.JudgeReply(verdicts=[pb.JudgeVerdict(text=verdict)])
    assert reply_problem(reply, 1, "judge", template).startswith("out_of_range")
