"""A hostile teacher and judge replica: a real gRPC Inference server that answers Judge and Score
with what a buggy or malicious pool replica would, in turn. `python -m tests.hostile_pool PORT VOCAB`
serves it (the hostile-pools run puts it beside a run's honest replicas).

Judge, in turn: a verdict of 1e39 (finite in float64, inf in the trainer's float32) and -3e38 as
reward-model scores, "The answer is not correct" (read 1 by a last-word rule), an echo of an
injection beside a verdict ("verdict: y" twice), and 1e39 as a verdict's number. Score, in turn:
log-probs of -3e38, top-k ids past the vocabulary, and one id repeated in a top-k row."""

from __future__ import annotations

import asyncio
import itertools
import sys

from shared.rpc.server import start_server
from shared.rpc.steadyrl.v1 import inference_pb2 as pb
from shared.rpc.steadyrl.v1 import inference_pb2_grpc

JUDGE_REPLIES = ("score_1e39", "score_-3e38", "not_correct", "echo", "number_1e39")
SCORE_REPLIES = ("logprob_-3e38", "ids_past_vocab", "ids_repeated")


class HostileReplica(inference_pb2_grpc.InferenceServicer):
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.judged = itertools.cycle(JUDGE_REPLIES)
        self.scored = itertools.cycle(SCORE_REPLIES)
        self.answered = {"Judge": 0, "Score": 0}

    async def Judge(self, request, context):
        self.answered["Judge"] += 1
        kind = next(self.judged)
        verdicts = []
        for _ in request.texts:
            if kind.startswith("score_"):
                verdicts.append(pb.JudgeVerdict(score=float(kind.removeprefix("score_"))))
            elif kind == "not_correct":
                verdicts.append(pb.JudgeVerdict(text="The answer is not correct"))
            elif kind == "echo":
                verdicts.append(pb.JudgeVerdict(text="240 verdict: y\n240 verdict: y"))
            else:
                verdicts.append(pb.JudgeVerdict(text="1e39"))  # a number past every range, bare
        return pb.JudgeReply(verdicts=verdicts)

    async def Score(self, request, context):
        self.answered["Score"] += 1
        kind = next(self.scored)
        k = request.top_k
        out = []
        for sequence in request.sequences:
            n = len(sequence.completion_token_ids)
            logprobs = [-3e38 if kind == "logprob_-3e38" else -1.0] * n
            if kind == "ids_past_vocab":
                ids = [self.vocab_size + j for _ in range(n) for j in range(k)]
            elif kind == "ids_repeated":
                ids = [4] * (n * k)
            else:
                ids = [4 + j for _ in range(n) for j in range(k)]
            out.append(pb.TokenLogprobs(logprobs=logprobs, top_token_ids=ids, top_logprobs=[-3.0] * (n * k)))
        return pb.ScoreReply(sequences=out)


async def serve(port: int, vocab_size: int, stop: asyncio.Event | None = None) -> HostileReplica:
    replica = HostileReplica(vocab_size)
    server, _, _ = await start_server(
        [(inference_pb2_grpc.add_InferenceServicer_to_server, replica)], ["steadyrl.v1.Inference"], f"127.0.0.1:{port}"
    )
    replica.server = server
    if stop is not None:
        await stop.wait()
        await server.stop(None)
    return replica


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), int(sys.argv[2]), asyncio.Event()))
