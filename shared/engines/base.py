"""What every inference engine offers: batched sampling with the logprob of each sampled token
under the distribution it was sampled from, per-token policy versions, optional routing traces,
and weight updates that land between decode steps."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from shared.rollouts.sampling import MAX_SCORE_TOP_K, Sampling

if TYPE_CHECKING:
    from shared.weightsync.base import Delivery


@dataclass
class Sample:
    """One completion: tokens, their logprobs and versions, why it ended, its routing trace."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"
    routing_trace: np.ndarray | None = None  # [P + C − 1, layers, top_k] when captured
    num_experts: int = 0


@dataclass
class Scored:
    """A teacher's scoring of one completion: the logprob of each of its tokens and, when asked, the
    k most likely tokens at each of its positions with their logprobs (most likely first)."""

    logprobs: list[float]
    top_ids: list[list[int]] = field(default_factory=list)  # [C][k]; empty when top_k = 0
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class Capabilities:
    routing_trace: bool
    logprobs: bool = True
    hot_swap: bool = True
    dtype: str = "float32"
    notes: tuple[str, ...] = field(default=())


# Called from the engine's thread for each token of one sequence as it is sampled: (token,
# logprob, the policy version that sampled it).
OnToken = Callable[[int, float, int], None]


class Engine(Protocol):
    """Continuous batching: sequences enter with `start` and leave as each finishes."""

    name: str
    model_path: str
    capabilities: Capabilities
    vocab_size: int
    max_model_len: int
    first_token_at: dict[int, float]  # wall time of the first token each version produced

    @property
    def version(self) -> int: ...

    @property
    def running(self) -> int:
        """Sequences being generated."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Why the engine can serve nothing any more, else None."""
        ...

    def start(
        self,
        prompt: list[int],
        sampling: Sampling,
        return_trace: bool = False,
        on_token: OnToken | None = None,
        index: int = 0,
    ) -> concurrent.futures.Future:
        """Submit one sequence (seeded sampling uses seed + index); its Sample arrives on the
        future. Callable from any thread."""
        ...

    def start_many(
        self, prompts: list[list[int]], sampling: Sampling, return_trace: bool = False, on_token: OnToken | None = None
    ) -> list[concurrent.futures.Future]:
        """`start` of prompt i with index i, `on_token` following the first; all are checked
        before any is queued, and an engine that batches admits them in one step (one prefill).
        A group submitted one by one is split over the steps its submissions straddle, and the
        submitting thread competes for the GIL with the forward it started."""
        ...

    def generate(
        self, prompts: list[list[int]], sampling: Sampling, return_trace: bool = False, on_token: OnToken | None = None
    ) -> list[Sample]:
        """Start every prompt (prompt i with index i) and wait for all; `on_token` follows the first."""
        ...

    def apply(self, delivery: Delivery) -> float:
        """Apply a version with generation paused between two steps (`update_mode`
        "between_requests": once the running sequences finished), bucket by bucket into the
        weights in place; returns the seconds generation was paused. WeightError: refused, the
        previous version still served; PartialVersion: some buckets landed, so the engine serves
        nothing until a whole version is applied. Callable from any thread."""
        ...

    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> float:
        """`apply` of a state dict handed in process (tests, tools)."""
        ...

    def weight_bytes(self, name: str, dtype: str) -> memoryview | None:
        """The raw bytes of a tensor as the version being served published it in `dtype` — the
        base a delta is decoded against — or None when the engine holds them otherwise (cast,
        quantized, packed, on a GPU): it then pulls versions whole."""
        ...

    def close(self) -> None: ...


def eos_ids(config) -> tuple[int, ...]:
    """The end-of-sequence token ids of a transformers config (none, one or several)."""
    eos = config.eos_token_id
    return tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()


def check_scored(
    sequences: list[tuple[list[int], list[int]]], vocab_size: int, max_model_len: int, top_k: int = 0
) -> None:
    """ValueError for a (prompt, completion) a teacher cannot score: empty, a token outside the
    vocabulary, longer than the engine's positions; or a top_k outside [0, MAX_SCORE_TOP_K]."""
    if not 0 <= top_k <= min(MAX_SCORE_TOP_K, vocab_size):
        raise ValueError(f"top_k {top_k} is outside [0, {min(MAX_SCORE_TOP_K, vocab_size)}]")
    for i, (prompt, completion) in enumerate(sequences):
        if not prompt or not completion:
            raise ValueError(f"sequence {i}: an empty prompt or completion")
        tokens = [*prompt, *completion]
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            raise ValueError(f"sequence {i}: token ids outside the vocabulary [0, {vocab_size})")
        if len(tokens) > max_model_len:
            raise ValueError(f"sequence {i}: {len(tokens)} tokens > the engine's {max_model_len} positions")


def check_request(
    prompt: list[int], sampling: Sampling, return_trace: bool, max_model_len: int, no_trace: str | None, vocab_size: int
) -> None:
    """ValueError when an engine cannot serve this request: an empty prompt, a token id outside the
    vocabulary (the prompt's or a stop token's: either would fail the batch's forward, not only
    this request), a routing trace asked of an engine that has none (`no_trace`: why, None when it
    has them), or a prompt with its max_new_tokens beyond the engine's context."""
    if not prompt:
        raise ValueError("every prompt needs at least one token")
    for what, ids in (("prompt", prompt), ("stop", sampling.stop_token_ids)):
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < vocab_size), None)  # bool is not int here
        if bad is not None:
            raise ValueError(f"{what} token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    if return_trace and no_trace is not None:
        raise ValueError(no_trace)
    if len(prompt) + sampling.max_new_tokens > max_model_len:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({sampling.max_new_tokens}) > {max_model_len}")


def processed_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Log-probabilities [B, V] of the distribution actually sampled from: logits / T, then top-k
    and top-p truncation (renormalised over what is kept), in float32. T = 0 (greedy) scores
    under T = 1."""
    scaled = logits.float() / (sampling.temperature if sampling.temperature > 0 else 1.0)
    if sampling.top_k > 0 and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
        drop_sorted = before >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def start_each(
    engine: Engine,
    prompts: list[list[int]],
    sampling: Sampling,
    return_trace: bool = False,
    on_token: OnToken | None = None,
) -> list[concurrent.futures.Future]:
    """`Engine.start_many` from `Engine.start`, for an engine that schedules on its own."""
    return [engine.start(p, sampling, return_trace, on_token if i == 0 else None, i) for i, p in enumerate(prompts)]


class _Inbox:
    """Callbacks another thread hands one event loop, run in the loop's next turn: the groups an
    engine step finishes wake the loop once together (the first one's pipe write), not once each."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = weakref.ref(loop)  # the inboxes are keyed by their loop: no reference keeps it alive
        self.lock = threading.Lock()
        self.waiting: list = []

    def post(self, callback) -> None:
        with self.lock:
            self.waiting.append(callback)
            if len(self.waiting) > 1:  # a wake-up is on its way: it runs this one too
                return
        loop = self.loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self.run)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            with self.lock:
                self.waiting.clear()

    def run(self) -> None:
        with self.lock:
            callbacks, self.waiting = self.waiting, []
        for callback in callbacks:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - one callback's failure must not strand the others
                asyncio.get_running_loop().call_exception_handler({"message": "engine callback", "exception": exc})


_inboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop → its _Inbox


def gathered(futures: list[concurrent.futures.Future]) -> asyncio.Future:
    """One asyncio future for a group's engine futures: the event loop wakes once, as the last one
    is done, not once per sample (a wake-up costs the engine thread a pipe write), and once for
    every group done at the same time (`_Inbox`). Its result is every sample in order; the first
    failure fails it; cancelling it does not cancel `futures`."""
    loop = asyncio.get_running_loop()
    inbox = _inboxes.get(loop) or _inboxes.setdefault(loop, _Inbox(loop))
    out = loop.create_future()
    left = [len(futures)]
    lock = threading.Lock()

    def settle() -> None:  # every future is done: one locked read each
        if out.done():
            return
        samples = []
        for future in futures:
            try:
                samples.append(future.result(timeout=0))
            except concurrent.futures.CancelledError:
                out.cancel()
                return
            except BaseException as exc:  # noqa: BLE001 - the sample's own failure fails the group
                out.set_exception(exc)
                return
        out.set_result(samples)

    def one_done(_: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            inbox.post(settle)

    if not futures:
        out.set_result([])
    for future in futures:
        future.add_done_callback(one_done)
    return out


def generate_all(
    engine: Engine,
    prompts: list[list[int]],
    sampling: Sampling,
    return_trace: bool = False,
    on_token: OnToken | None = None,
) -> list[Sample]:
    """`Engine.generate` from `Engine.start_many`."""
    if not prompts:
        raise ValueError("no prompts")
    return [f.result() for f in engine.start_many(prompts, sampling, return_trace, on_token)]
