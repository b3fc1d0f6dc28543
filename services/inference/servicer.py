"""A replica's Inference gRPC API, one servicer made of the roles the replica plays: a rollout replica's
`Generate` (one request, streamed token by token, every value checked first) and `Status`, a teacher's `Score`
(logprobs of given completions: one prefill) and a judge's `Judge` (a generative judge's greedy verdicts, or a
reward model's scalars). A replica with an engine plays them all (`engine_servicer`); one serving a reward model
answers Judge and Status only (`reward_model_servicer`): an RPC whose role it lacks is UNIMPLEMENTED."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from services.inference.config import InferenceSettings
from services.inference.metrics import POOL_FAILURES, POOL_QUEUE, POOL_REQUESTS, POOL_SECONDS, POOL_TOKENS
from services.inference.worker import RolloutWorker
from shared.engines import Engine, Sampling
from shared.engines.base import gathered
from shared.engines.classifier import SequenceClassifier
from shared.models.loading import decode_completions, encode_prompt
from shared.rollouts.record import trace_message
from shared.rpc.steadyrl.v1 import common_pb2, inference_pb2_grpc
from shared.rpc.steadyrl.v1 import inference_pb2 as pb
from shared.runstore.queues import WorkQueue


async def abort(context, message: str, code=grpc.StatusCode.INVALID_ARGUMENT):
    await context.abort(code, message)


def text_bound(tokenizer, max_model_len: int) -> int:
    """Characters a text may have before it is tokenized: a token covers at most the longest token's
    characters, so a longer text is past `max_model_len` tokens for certain (4× slack for a normalizer
    that joins characters). Checked first, so a text of megabytes is refused at once, not after seconds
    of tokenizing on the replica's event loop."""
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return 4 * max(longest, 1) * max_model_len


class Generation:
    """A rollout replica's Generate: one request streamed token by token, every value checked first."""

    def __init__(self, settings: InferenceSettings, engine: Engine, tokenizer) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_chars = text_bound(tokenizer, engine.max_model_len)

    async def stream(self, request, context):
        if request.prompt_token_ids and request.prompt_text:
            await abort(context, "give prompt_token_ids or prompt_text, not both")
        if request.prompt_token_ids:
            prompt = list(request.prompt_token_ids)
            bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
            if bad:
                await abort(context, f"token ids {bad[:5]} outside the vocabulary [0, {self.engine.vocab_size})")
        elif len(request.prompt_text) > self.max_chars:
            await abort(
                context,
                f"prompt_text of {len(request.prompt_text)} characters is past {self.engine.max_model_len} tokens",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        elif request.prompt_text:
            prompt = list(self.tokenizer(request.prompt_text).input_ids)
        else:
            await abort(context, "give prompt_token_ids or prompt_text")
        try:
            sampling = Sampling.from_proto(request.sampling)
        except ValueError as exc:
            await abort(context, str(exc))
        if sampling.max_new_tokens > self.settings.max_new_tokens_limit:
            await abort(
                context,
                f"max_new_tokens {sampling.max_new_tokens} > limit {self.settings.max_new_tokens_limit}",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        if len(prompt) + sampling.max_new_tokens > self.engine.max_model_len:
            await abort(
                context,
                f"prompt ({len(prompt)}) + max_new_tokens ({sampling.max_new_tokens}) > {self.engine.max_model_len}",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        if request.return_routing_trace and not self.engine.capabilities.routing_trace:
            await abort(
                context,
                f"the {self.engine.name} engine returns no routing traces here",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_token(token: int, logprob: float, version: int) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (token, logprob, version))

        try:
            job = asyncio.wrap_future(self.engine.start(prompt, sampling, request.return_routing_trace, on_token))
        except ValueError as exc:
            await abort(context, str(exc))
        try:
            while not (job.done() and events.empty()):
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                token, logprob, version = getter.result()
                yield pb.GenerateEvent(
                    token_id=token,
                    inference_logprob=logprob,
                    policy_version=version,
                    text=self.tokenizer.decode([token]),
                )
        finally:
            job.cancel()  # the client went away: the engine drops the sequence (or never starts it)
        sample = job.result()
        final = pb.GenerateEvent(
            token_id=-1, done=True, finish_reason=sample.finish_reason, policy_version=sample.versions[-1]
        )
        if sample.routing_trace is not None:
            final.routing_trace = trace_message(sample.routing_trace, sample.num_experts).SerializeToString()
        yield final


class Scoring:
    """A teacher's Score: log p(each completion token | what precedes it) for every sequence, and the
    request's top_k most likely tokens at each completion position, from one prefill."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model = engine.model_path

    def can(self) -> bool:
        return getattr(self.engine, "score", None) is not None

    async def score(self, request) -> tuple[list[pb.TokenLogprobs], int]:
        """The scored sequences and their completion tokens; ValueError for a request that cannot be scored."""
        sequences = [(list(s.prompt_token_ids), list(s.completion_token_ids)) for s in request.sequences]
        if not sequences:
            raise ValueError("no sequence to score")
        scored = await asyncio.to_thread(self.engine.score, sequences, request.top_k)  # between two engine steps
        replies = [
            pb.TokenLogprobs(
                logprobs=s.logprobs,
                top_token_ids=[t for row in s.top_ids for t in row],
                top_logprobs=[x for row in s.top_logprobs for x in row],
            )
            for s in scored
        ]
        return replies, sum(len(c) for _, c in sequences)


class Judging(Protocol):
    """A judge's Judge: a verdict per text."""

    model: str

    async def verdicts(self, texts: list[str], max_new_tokens: int) -> tuple[list[pb.JudgeVerdict], int]:
        """The verdicts and the tokens generated; ValueError for a text that cannot be judged."""
        ...


class GenerativeJudging:
    """A generative judge's greedy completions of at most `max_new_tokens` tokens (the texts batched in the engine)."""

    def __init__(self, settings: InferenceSettings, engine: Engine, tokenizer) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = engine.model_path
        self.max_chars = text_bound(tokenizer, engine.max_model_len)

    async def verdicts(self, texts: list[str], max_new_tokens: int) -> tuple[list[pb.JudgeVerdict], int]:
        if max_new_tokens > self.settings.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens {max_new_tokens} > limit {self.settings.max_new_tokens_limit}")
        long = next((i for i, text in enumerate(texts) if len(text) > self.max_chars), None)
        if long is not None:
            raise ValueError(
                f"text {long}: {len(texts[long])} characters, past the judge's {self.engine.max_model_len}"
            )
        prompts = [encode_prompt(self.tokenizer, text) for text in texts]
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_new_tokens > self.engine.max_model_len:
                raise ValueError(
                    f"text {i}: {len(prompt)} tokens + {max_new_tokens} new > the judge's {self.engine.max_model_len}"
                )
        sampling = Sampling(temperature=0.0, max_new_tokens=max_new_tokens)
        samples = await gathered(self.engine.start_many(prompts, sampling))
        completions = [s.token_ids for s in samples]
        verdicts = [pb.JudgeVerdict(text=t) for t in decode_completions(self.tokenizer, completions)]
        return verdicts, sum(map(len, completions))


class RewardModelJudging:
    """A reward model's scalar per text (no token generated)."""

    def __init__(self, classifier: SequenceClassifier) -> None:
        self.classifier = classifier
        self.model = classifier.model_path

    async def verdicts(self, texts: list[str], max_new_tokens: int) -> tuple[list[pb.JudgeVerdict], int]:
        scores = await asyncio.to_thread(self.classifier.scores, texts)
        return [pb.JudgeVerdict(score=value) for value in scores], 0


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """The Inference API from a replica's roles (`status`: its Status reply; `generation`, `scoring`: None where the
    replica plays no such role)."""

    def __init__(
        self,
        settings: InferenceSettings,
        status: Callable[[], Awaitable[pb.InferenceStatus]],
        judging: Judging,
        *,
        generation: Generation | None = None,
        scoring: Scoring | None = None,
    ) -> None:
        self.settings = settings
        self.status = status
        self.judging = judging
        self.generation = generation
        self.scoring = scoring

    async def Generate(self, request, context):
        if self.generation is None:
            await abort(context, "a reward model's replica does not generate", grpc.StatusCode.UNIMPLEMENTED)
        async for event in self.generation.stream(request, context):
            yield event

    async def Score(self, request, context):
        if self.scoring is None or not self.scoring.can():
            engine = self.scoring.engine.name if self.scoring else "reward model's"
            POOL_FAILURES.labels(self.settings.pool, self.settings.replica_id, "unimplemented").inc()
            await abort(context, f"the {engine} engine does not score", grpc.StatusCode.UNIMPLEMENTED)
        replies, tokens = await self._pool_call(context, "Score", self.scoring.score(request))
        return pb.ScoreReply(sequences=replies, model=self.scoring.model)

    async def Judge(self, request, context):
        texts = list(request.texts)
        if not texts:
            POOL_FAILURES.labels(self.settings.pool, self.settings.replica_id, "invalid").inc()
            await abort(context, "no text to judge")
        verdicts, tokens = await self._pool_call(
            context, "Judge", self.judging.verdicts(texts, request.max_new_tokens or 8)
        )
        return pb.JudgeReply(verdicts=verdicts, model=self.judging.model)

    async def Status(self, request, context):
        return await self.status()

    async def _pool_call(self, context, method: str, work: Awaitable[tuple]) -> tuple:
        """`work`'s (reply, tokens) as a pool's call, counted: queued, requests, tokens, seconds; a ValueError
        it raises answers INVALID_ARGUMENT."""
        pool, replica = self.settings.pool, self.settings.replica_id
        started = time.perf_counter()
        POOL_QUEUE.labels(pool).inc()
        try:
            reply, tokens = await work
        except ValueError as exc:
            POOL_FAILURES.labels(pool, replica, "invalid").inc()
            await abort(context, str(exc))
        finally:
            POOL_QUEUE.labels(pool).dec()
        POOL_REQUESTS.labels(pool, replica, method).inc()
        POOL_TOKENS.labels(pool, replica).inc(tokens)
        POOL_SECONDS.labels(pool, replica).observe(time.perf_counter() - started)
        return reply, tokens


def engine_servicer(
    settings: InferenceSettings, engine: Engine, tokenizer, queue: WorkQueue, worker: RolloutWorker | None = None
) -> InferenceServicer:
    """A replica with an engine plays every role (`worker`: a rollout replica's loop, whose progress Status
    reports; `queue`: the work queue whose pending tasks Status reports)."""

    async def status() -> pb.InferenceStatus:
        caps = engine.capabilities
        return pb.InferenceStatus(
            replica_id=settings.replica_id,
            engine=engine.name,
            model=engine.model_path,
            version=common_pb2.PolicyVersion(version=engine.version),
            capabilities=pb.EngineCapabilities(
                routing_trace=caps.routing_trace, logprobs=caps.logprobs, hot_swap=caps.hot_swap, dtype=caps.dtype
            ),
            queue_lag=await queue_lag(queue),
            rollouts_published=worker.sent if worker else 0,
            tokens_per_second=worker.tokens_per_second if worker else 0.0,
            busy=bool(worker and worker.busy),
        )

    return InferenceServicer(
        settings,
        status,
        GenerativeJudging(settings, engine, tokenizer),
        generation=Generation(settings, engine, tokenizer),
        scoring=Scoring(engine),
    )


def reward_model_servicer(settings: InferenceSettings, classifier: SequenceClassifier) -> InferenceServicer:
    """A judge pool's replica on a reward model: Judge and Status only."""

    async def status() -> pb.InferenceStatus:
        return pb.InferenceStatus(
            replica_id=settings.replica_id,
            engine=classifier.name,
            model=classifier.model_path,
            version=common_pb2.PolicyVersion(version=0),
            capabilities=pb.EngineCapabilities(dtype=settings.dtype),
            queue_lag=0,
        )

    return InferenceServicer(settings, status, RewardModelJudging(classifier))


async def queue_lag(queue: WorkQueue) -> int:
    """The queue's pending tasks; 0 when Redis does not answer."""
    with contextlib.suppress(Exception):
        return await queue.pending_count()
    return 0
