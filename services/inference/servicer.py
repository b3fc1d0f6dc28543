"""A replica's Inference gRPC API: `Generate` (one request, streamed token by token, every
value checked first), `Score` (a teacher's logprobs of given completions: one prefill), `Judge` (a
judge's greedy verdicts, or a reward model's scalars) and `Status`."""

from __future__ import annotations

import asyncio
import contextlib
import time

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


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self,
        settings: InferenceSettings,
        engine: Engine,
        tokenizer,
        queue: WorkQueue | None,
        worker: RolloutWorker | None,
        classifier: SequenceClassifier | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine  # None on a reward model's replica: it answers Judge and Status only
        self.tokenizer = tokenizer
        self.queue = queue
        self.worker = worker
        self.classifier = classifier

    async def _invalid(self, context, message: str, code=grpc.StatusCode.INVALID_ARGUMENT):
        await context.abort(code, message)

    async def Generate(self, request, context):
        if self.engine is None:
            await self._invalid(context, "a reward model's replica does not generate", grpc.StatusCode.UNIMPLEMENTED)
        if request.prompt_token_ids:
            prompt = list(request.prompt_token_ids)
            bad = [t for t in prompt if not 0 <= t < self.engine.vocab_size]
            if bad:
                await self._invalid(
                    context, f"token ids {bad[:5]} outside the vocabulary [0, {self.engine.vocab_size})"
                )
        elif request.prompt_text:
            prompt = list(self.tokenizer(request.prompt_text).input_ids)
        else:
            await self._invalid(context, "give prompt_token_ids or prompt_text")
        try:
            sampling = Sampling.from_proto(request.sampling)
        except ValueError as exc:
            await self._invalid(context, str(exc))
        if sampling.max_new_tokens > self.settings.max_new_tokens_limit:
            await self._invalid(
                context,
                f"max_new_tokens {sampling.max_new_tokens} > limit {self.settings.max_new_tokens_limit}",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        if len(prompt) + sampling.max_new_tokens > self.engine.max_model_len:
            await self._invalid(
                context,
                f"prompt ({len(prompt)}) + max_new_tokens ({sampling.max_new_tokens}) > {self.engine.max_model_len}",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        if request.return_routing_trace and not self.engine.capabilities.routing_trace:
            await self._invalid(
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
            await self._invalid(context, str(exc))
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

    async def Score(self, request, context):
        """log p(each completion token | what precedes it) for every sequence, and the request's top_k
        most likely tokens at each completion position, from one prefill."""
        pool, replica = self.settings.pool, self.settings.replica_id
        score = getattr(self.engine, "score", None)
        if score is None:
            engine = self.engine.name if self.engine else "reward model's"
            POOL_FAILURES.labels(pool, replica, "unimplemented").inc()
            await self._invalid(context, f"the {engine} engine does not score", grpc.StatusCode.UNIMPLEMENTED)
        sequences = [(list(s.prompt_token_ids), list(s.completion_token_ids)) for s in request.sequences]
        if not sequences:
            POOL_FAILURES.labels(pool, replica, "invalid").inc()
            await self._invalid(context, "no sequence to score")
        started = time.perf_counter()
        POOL_QUEUE.labels(pool).inc()
        try:
            scored = await asyncio.to_thread(score, sequences, request.top_k)  # waits for the engine between two steps
        except ValueError as exc:
            POOL_FAILURES.labels(pool, replica, "invalid").inc()
            await self._invalid(context, str(exc))
        finally:
            POOL_QUEUE.labels(pool).dec()
        POOL_REQUESTS.labels(pool, replica, "Score").inc()
        POOL_TOKENS.labels(pool, replica).inc(sum(len(c) for _, c in sequences))
        POOL_SECONDS.labels(pool, replica).observe(time.perf_counter() - started)
        return pb.ScoreReply(
            sequences=[
                pb.TokenLogprobs(
                    logprobs=s.logprobs,
                    top_token_ids=[t for row in s.top_ids for t in row],
                    top_logprobs=[x for row in s.top_logprobs for x in row],
                )
                for s in scored
            ],
            model=self.engine.model_path,
        )

    async def Judge(self, request, context):
        """A verdict per text: a reward model's scalar, or a generative judge's greedy completion of
        at most `max_new_tokens` tokens (the texts batched in the engine)."""
        pool, replica = self.settings.pool, self.settings.replica_id
        texts = list(request.texts)
        if not texts:
            POOL_FAILURES.labels(pool, replica, "invalid").inc()
            await self._invalid(context, "no text to judge")
        started = time.perf_counter()
        POOL_QUEUE.labels(pool).inc()
        try:
            if self.classifier is not None:
                scores = await asyncio.to_thread(self.classifier.scores, texts)
                verdicts = [pb.JudgeVerdict(score=value) for value in scores]
                tokens = 0
            else:
                verdicts, tokens = await self._generate_verdicts(texts, request.max_new_tokens or 8)
        except ValueError as exc:
            POOL_FAILURES.labels(pool, replica, "invalid").inc()
            await self._invalid(context, str(exc))
        finally:
            POOL_QUEUE.labels(pool).dec()
        POOL_REQUESTS.labels(pool, replica, "Judge").inc()
        POOL_TOKENS.labels(pool, replica).inc(tokens)
        POOL_SECONDS.labels(pool, replica).observe(time.perf_counter() - started)
        model = self.classifier.model_path if self.classifier else self.engine.model_path
        return pb.JudgeReply(verdicts=verdicts, model=model)

    async def _generate_verdicts(self, texts: list[str], max_new_tokens: int) -> tuple[list, int]:
        """Greedy verdicts and the tokens generated; ValueError for a text that cannot be judged."""
        if max_new_tokens > self.settings.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens {max_new_tokens} > limit {self.settings.max_new_tokens_limit}")
        prompts = [encode_prompt(self.tokenizer, text) for text in texts]
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_new_tokens > self.engine.max_model_len:
                raise ValueError(
                    f"text {i}: {len(prompt)} tokens + {max_new_tokens} new > the judge's {self.engine.max_model_len}"
                )
        sampling = Sampling(temperature=0.0, max_new_tokens=max_new_tokens)
        samples = await gathered(self.engine.start_many(prompts, sampling))
        completions = [s.token_ids for s in samples]
        return [pb.JudgeVerdict(text=t) for t in decode_completions(self.tokenizer, completions)], sum(
            map(len, completions)
        )

    async def Status(self, request, context):
        lag = 0
        if self.queue is not None:
            with contextlib.suppress(Exception):
                lag = await self.queue.pending_count()
        if self.engine is None:  # a reward model's replica
            return pb.InferenceStatus(
                replica_id=self.settings.replica_id,
                engine=self.classifier.name,
                model=self.classifier.model_path,
                version=common_pb2.PolicyVersion(version=0),
                capabilities=pb.EngineCapabilities(dtype=self.settings.dtype),
                queue_lag=lag,
            )
        caps = self.engine.capabilities
        return pb.InferenceStatus(
            replica_id=self.settings.replica_id,
            engine=self.engine.name,
            model=self.engine.model_path,
            version=common_pb2.PolicyVersion(version=self.engine.version),
            capabilities=pb.EngineCapabilities(
                routing_trace=caps.routing_trace, logprobs=caps.logprobs, hot_swap=caps.hot_swap, dtype=caps.dtype
            ),
            queue_lag=lag,
            rollouts_published=self.worker.published if self.worker else 0,
            tokens_per_second=self.worker.tokens_per_second if self.worker else 0.0,
            busy=bool(self.worker and self.worker.busy),
        )
