"""A judge pool for real: a generative judge replica (`python -m services.inference`, pool `judge`, the
tiny model) and a reward model's replica (a tiny Qwen3 sequence classifier, no engine), reached
through `PoolClient` — Judge's verdicts equal the engine's own greedy completions and the classifier's
own logits, the rollout replica's `JudgeScoring` turns them into rewards (and rule rewards beside),
and invalid requests fail with their reason without a retry."""

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
import torch

from bench.faults import wait_serving
from services.inference.config import JudgeTemplate
from services.inference.judge import JudgeScoring
from shared.engines import Sampling, make_engine
from shared.kit.tiny import char_tokenizer
from shared.models.loading import decode_completions, encode_prompt
from shared.rpc.pool_client import PoolClient, PoolError
from shared.rpc.steadyrl.v1 import inference_pb2 as pb
from shared.rpc.steadyrl.v1 import inference_pb2_grpc
from shared.runstore.redis_server import free_port
from shared.tasks import RewardRunner
from shared.tasks.judging import parse_verdict

TEXTS = ["07+35=240?", "11+22=330?", "90+19=901?"]


def judge_replica(model_dir, port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "STEADYRL_INFERENCE_MODEL_PATH": str(model_dir),
        "STEADYRL_INFERENCE_DTYPE": "float32",
        "STEADYRL_INFERENCE_POOL": "judge",
        "STEADYRL_INFERENCE_PORT": str(port),
        "STEADYRL_INFERENCE_METRICS_PORT": "0",
        "STEADYRL_INFERENCE_REPLICA_ID": f"judge-{port}",
        "STEADYRL_INFERENCE_TORCH_THREADS": "1",
        "STEADYRL_INFERENCE_MAX_NEW_TOKENS_LIMIT": "16",
    }
    return subprocess.Popen([sys.executable, "-m", "services.inference"], env=env, stdout=subprocess.DEVNULL)


def reward_model(directory):
    """A tiny Qwen3 sequence classifier (one label: its logit is the reward) with the kit's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen3ForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)
    return model


def test_a_judge_and_a_reward_model_answer_judge(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("STEADYRL_TOKEN", raising=False)
    classifier = reward_model(tmp_path / "rm")
    tokenizer = char_tokenizer()
    with torch.no_grad():  # the reward model's own logit of each text, one at a time (no padding)
        expected_scores = [
            classifier(input_ids=torch.tensor([encode_prompt(tokenizer, t)])).logits[0, 0].item() for t in TEXTS
        ]
    engine = make_engine("torch", str(tiny_model_dir), "float32")
    samples = engine.generate([encode_prompt(tokenizer, t) for t in TEXTS], Sampling(temperature=0.0, max_new_tokens=6))
    expected_texts = decode_completions(tokenizer, [s.token_ids for s in samples])
    engine.close()
    judge_port, rm_port = free_port(), free_port()
    replicas = [judge_replica(tiny_model_dir, judge_port), judge_replica(tmp_path / "rm", rm_port)]
    try:
        wait_serving(judge_port)
        wait_serving(rm_port)

        async def main():
            def client(port):
                return PoolClient("judge", [f"127.0.0.1:{port}"], inference_pb2_grpc.InferenceStub, 30.0, 2, 0.05)

            judge, rm = client(judge_port), client(rm_port)
            out = {
                "texts": await judge.call("Judge", pb.JudgeRequest(texts=TEXTS, max_new_tokens=6)),
                "scores": await rm.call("Judge", pb.JudgeRequest(texts=TEXTS)),
            }
            with pytest.raises(PoolError, match="INVALID_ARGUMENT no text to judge"):
                await judge.call("Judge", pb.JudgeRequest())
            with pytest.raises(PoolError, match="INVALID_ARGUMENT max_new_tokens 17 > limit 16"):
                await judge.call("Judge", pb.JudgeRequest(texts=TEXTS, max_new_tokens=17))
            with pytest.raises(PoolError, match="INVALID_ARGUMENT text 0: .* > the judge's 64"):
                await judge.call("Judge", pb.JudgeRequest(texts=["1" * 60], max_new_tokens=6))
            with pytest.raises(PoolError, match="INVALID_ARGUMENT text 1: 4000000 characters, past the judge's 64"):
                await judge.call("Judge", pb.JudgeRequest(texts=["1", "1" * 4_000_000], max_new_tokens=6))
            stream = inference_pb2_grpc.InferenceStub(rm.channels[0]).Generate(pb.GenerateRequest(prompt_text="1"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stream.read()
            out["generate"] = refused.value.code()
            bare = {"anchor": "", "markers": ("", "")}  # the tiny policy's digits, read whole as the verdict
            templates = {
                "sum": JudgeTemplate(prompt="{prompt}{response}?", rule="number", max_new_tokens=6, **bare),
                "sum_checked": JudgeTemplate(
                    prompt="{prompt}{response}?", rule="number", compare_with="exact_match", **bare
                ),
            }
            rewards = RewardRunner()
            scoring = JudgeScoring(judge, templates, rewards)
            out["judged"] = await scoring.score("judge:sum", "07+35=", ["240", "111"], "240")
            out["compared"] = await scoring.score("judge:sum_checked", "07+35=", ["240", "111"], "240")
            out["rm"] = await JudgeScoring(rm, {"sum": templates["sum"]}, rewards).score(
                "reward_model:sum", "07+35=", ["240"], "240"
            )
            with pytest.raises(PoolError, match="a score where a generative judge's text was asked"):
                await JudgeScoring(rm, templates, rewards).score("judge:sum", "07+35=", ["240"], "240")
            rewards.close()
            await judge.close()
            await rm.close()
            return out

        out = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        for replica in replicas:
            replica.terminate()
            replica.wait(20)
    assert [v.text for v in out["texts"].verdicts] == expected_texts
    assert [v.score for v in out["scores"].verdicts] == pytest.approx(expected_scores, abs=1e-5)
    assert out["generate"] == grpc.StatusCode.UNIMPLEMENTED
    scores, reference = out["judged"]
    assert reference is None and len(scores) == 2
    for score, text in zip(scores, [expected_texts[0], None], strict=True):
        if text is not None:  # the judge's verdict on "07+35=240?" is the first text above
            value = parse_verdict(text, "number", {}, anchor="") if text.strip().isdigit() else 0.0
            assert score.value == value
    assert all(s.reason in ("", "verdict:unparsed", "verdict:empty") for s in scores)
    assert out["compared"][1] == [1.0, 0.0]
    [rm_score], rm_reference = out["rm"]
    assert rm_score.value == pytest.approx(expected_scores[0], abs=1e-5) and rm_reference is None
