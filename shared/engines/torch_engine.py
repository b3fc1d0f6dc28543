"""The reference engine: a transformers causal LM with continuous batching on a thread of its own.

Sequences enter as they are submitted (`start`) and leave as they finish; every row's logprobs are those of a fresh
full forward. `apply` copies a version into the model in place between decode steps: "in_flight" recomputes the
running sequences' KV under it, "between_requests" lets them finish on the old weights (one version per rollout).
Routing traces come from the forwards that sample. Device: the CPU or a GPU (`device="cuda"`); a seed gives the same
tokens on the same device. `exact`: every forward batch-invariant (`shared.models.batch_invariant`), so a token's
logprob is bit for bit the trainer's recompute of it (docs/guides/exact.md).

Details: docs/internals/engines.md"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
import weakref

import torch

from shared.engines.base import (
    Capabilities,
    OnToken,
    Sampling,
    Scored,
    check_request,
    check_scored,
    eos_ids,
    generate_all,
)
from shared.engines.sequences import (
    Seq,
    SeqFuture,
    append_rows,
    forward,
    keep_rows,
    prefill,
    result_of,
    sample_next,
)
from shared.engines.torch_weights import InPlaceWeights, load_model
from shared.models import batch_invariant
from shared.models.loading import resolve_dtype
from shared.models.routing import RoutingController
from shared.runtime.torch_threads import bind_torch_threads
from shared.weightsync.base import Delivery, PartialVersion, StateDictDelivery

log = logging.getLogger("steadyrl.engines.torch")
UPDATE_MODES = ("in_flight", "between_requests")


def _width(sequence: tuple[list[int], list[int]]) -> int:
    return len(sequence[0]) + len(sequence[1])


def _close_at_exit(engine: weakref.ref) -> None:
    """Close before the interpreter stops: a daemon thread cut off inside torch aborts the process."""
    alive = engine()
    if alive is not None:
        alive.close()


class TorchEngine:
    name = "torch"

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        version: int = 0,
        threads: int = 0,
        max_num_seqs: int = 256,
        update_mode: str = "in_flight",
        quantization: str = "none",
        quantize_router: bool = False,
        quantize_activations: bool = False,
        device: str = "cpu",
        exact: bool = False,
    ) -> None:
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"update_mode must be one of {UPDATE_MODES}, got {update_mode!r}")
        if exact and (resolve_dtype(dtype) != torch.float32 or quantization != "none"):
            raise ValueError(
                f"exact mode computes as the trainer does: dtype float32 and no quantization "
                f"(got {dtype}, quantization {quantization})"
            )
        self.exact = exact
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"the torch engine was asked for {device} and no CUDA device is visible")
        self.threads = threads
        self.max_num_seqs = max_num_seqs
        self.update_mode = update_mode
        self.model_path = str(model_path)
        self.dtype = resolve_dtype(dtype)
        self.model, self.quantized, self.activations, notes = load_model(
            model_path, self.dtype, self.device, quantization, quantize_router, quantize_activations
        )
        if exact:
            batch_invariant.prepare(self.model)
        self.routing = RoutingController(self.model)
        self.quantization = quantization
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(getattr(config, "max_position_embeddings", 4096))
        self.eos_token_ids = eos_ids(config)
        self.pad_token_id = int(getattr(config, "pad_token_id", None) or 0)
        self.capabilities = Capabilities(
            routing_trace=self.routing.is_moe,
            dtype=str(self.dtype).removeprefix("torch."),
            notes=(
                *notes,
                *([f"on {self.device}"] if self.device.type != "cpu" else []),
                *(["exact: batch-invariant forwards"] if exact else []),
            ),
        )
        self.weights = InPlaceWeights(self.model, self.quantized, quantization, self.model_path)
        self._version = version
        self._lock = threading.Lock()  # held over each step: an update takes it between two
        self._updates = 0  # updates waiting: no admission meanwhile (see _can_step)
        self._broken = False  # a version failed after its first bucket: nothing runs until a whole one
        self._waiting: collections.deque[Seq] = collections.deque()
        self._live: list[Seq] = []
        self._cache = None  # the running batch's KV cache, rows in `_live` order
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._built_on = version  # the weights the cache was computed with
        self._wake = threading.Condition()
        self._closed = False
        self.steps = 0
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self.first_token_at: dict[int, float] = {}  # wall time of the first token each version produced
        self._checked = threading.Event()  # the engine thread checked its kernels (exact mode)
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))
        self._checked.wait()
        if self.error is not None:
            self._thread.join(30)
            raise self.error

    # --- the public side ---------------------------------------------------------------------------

    generate = generate_all

    def start(
        self,
        prompt: list[int],
        sampling: Sampling,
        return_trace: bool = False,
        on_token: OnToken | None = None,
        index: int = 0,
    ) -> concurrent.futures.Future:
        """Queue one sequence; its Sample arrives on the future. Seeded sampling uses `seed +
        index`, so a group's samples differ and none depends on what else runs."""
        return self._queue([self._seq(prompt, sampling, return_trace, on_token, index)])[0]

    def start_many(
        self, prompts: list[list[int]], sampling: Sampling, return_trace: bool = False, on_token: OnToken | None = None
    ) -> list[concurrent.futures.Future]:
        checked: set[int] = set()  # a group's prompts are one list: checked once (ids of lists alive here)
        seqs = []
        for i, p in enumerate(prompts):
            seqs.append(self._seq(p, sampling, return_trace, on_token if i == 0 else None, i, id(p) not in checked))
            checked.add(id(p))
        return self._queue(seqs)

    def _seq(
        self,
        prompt: list[int],
        sampling: Sampling,
        return_trace: bool,
        on_token: OnToken | None,
        index: int,
        check: bool = True,
    ):
        if check:
            check_request(
                prompt,
                sampling,
                return_trace,
                self.max_model_len,
                None if self.capabilities.routing_trace else "this model has no MoE router: no routing trace to return",
                self.vocab_size,
            )
            refused = self.refused_sampling(sampling)
            if refused is not None:
                raise ValueError(refused)
        seed = sampling.seed + index if sampling.seed else 0
        return Seq(list(prompt), sampling, seed, return_trace, on_token, SeqFuture())

    def refused_sampling(self, sampling: Sampling) -> str | None:
        """Why this engine never samples with `sampling` (None when it does): exact mode samples the
        model's own distribution, the one the trainer scores."""
        if self.exact and (sampling.temperature not in (0.0, 1.0) or sampling.top_p < 1.0 or sampling.top_k > 0):
            return (
                "exact mode samples the model's own distribution (temperature 1, or 0 for greedy; no top-k or "
                f"top-p), as the trainer scores it: got temperature {sampling.temperature:g}, top_k "
                f"{sampling.top_k}, top_p {sampling.top_p:g}"
            )
        return None

    def _queue(self, seqs: list[Seq]) -> list[concurrent.futures.Future]:
        with self._wake:
            if self._closed or self.error is not None:
                raise RuntimeError(f"the torch engine is stopped{f': {self.error}' if self.error else ''}")
            self._waiting.extend(seqs)
            self._wake.notify()
        return [seq.future for seq in seqs]

    def apply(self, delivery: Delivery) -> float:
        if threading.current_thread() is self._thread:
            raise RuntimeError("apply from the engine's own thread (an on_token callback) would wait on itself")
        delivery.prepare()  # generation goes on meanwhile
        with self._wake:
            self._updates += 1
            self._wake.notify()
        try:
            while True:
                with self._wake:  # between_requests: the running sequences finish on the old weights
                    while self.update_mode == "between_requests" and self._live and not self._closed:
                        self._wake.wait(0.05)
                with self._lock:  # the engine thread holds it over each step: this is between two
                    if self.update_mode != "between_requests" or not self._live:
                        return self._copy_in(delivery)
        finally:
            with self._wake:
                self._updates -= 1
                self._wake.notify_all()

    def _copy_in(self, delivery: Delivery) -> float:
        started = time.perf_counter()
        try:
            self.weights.copy_in(delivery)
        except PartialVersion:
            self._broken = True
            raise
        self._broken = False
        self._version = delivery.version
        return time.perf_counter() - started

    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> float:
        return self.apply(StateDictDelivery(version, state_dict))

    def weight_bytes(self, name: str, dtype: str) -> memoryview | None:
        return self.weights.bytes_of(name, dtype)

    def takes_patch(self, manifest) -> bool:
        """Whether a patch version applies here: the engine serves its base, whole, and holds every
        patched tensor as published (on the CPU or a GPU)."""
        return self._version == manifest.patch_base and not self._broken and self.weights.holds_published(manifest)

    def score(
        self, sequences: list[tuple[list[int], list[int]]], top_k: int = 0, chunk_tokens: int = 16384
    ) -> list[Scored]:
        """A teacher's scoring: log p(each completion token | the prompt and the completion before it)
        for every (prompt, completion), and the `top_k` most likely tokens at each of its positions,
        by prefill forwards of right-padded chunks of at most `chunk_tokens` tokens, under the
        engine's lock (between two decode steps). ValueError for a sequence that cannot be scored
        (empty, out of the vocabulary, longer than the context) or a top_k beyond the limit."""
        check_scored(sequences, self.vocab_size, self.max_model_len, top_k)
        out: list[Scored] = []
        start = 0
        exact = batch_invariant.BatchInvariant() if self.exact else contextlib.nullcontext()
        with self._lock, torch.inference_mode(), exact:
            bind_torch_threads(self.threads)
            while start < len(sequences):
                end, longest = start, 0
                while end < len(sequences) and (
                    end == start or (end + 1 - start) * max(longest, _width(sequences[end])) <= chunk_tokens
                ):
                    longest = max(longest, _width(sequences[end]))
                    end += 1
                out += self._score_chunk(sequences[start:end], longest, top_k)
                start = end
        return out

    def _score_chunk(self, sequences: list[tuple[list[int], list[int]]], width: int, top_k: int) -> list[Scored]:
        ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, (prompt, completion) in enumerate(sequences):
            n = len(prompt) + len(completion)
            ids[row, :n] = torch.tensor([*prompt, *completion])
            mask[row, :n] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        log_softmax = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logprobs = log_softmax.gather(-1, ids[:, 1:, None].to(self.device)).squeeze(-1).cpu()
        top_logprobs, top_ids = log_softmax.topk(top_k, dim=-1) if top_k else (None, None)
        out = []
        for row, (prompt, completion) in enumerate(sequences):
            span = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)
            scored = Scored(logprobs[row, span].tolist())
            if top_k:
                scored.top_ids = top_ids[row, span].cpu().tolist()
                scored.top_logprobs = top_logprobs[row, span].cpu().tolist()
            out.append(scored)
        return out

    @property
    def version(self) -> int:
        return self._version

    @property
    def running(self) -> int:
        return len(self._live)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(30)
        self.routing.close()

    # --- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        bind_torch_threads(self.threads)
        try:
            if self.exact:  # on this thread's kernels and thread count, where the forwards run
                batch_invariant.check_kernels(self.model, self.device)
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it
            self.error = exc
            return
        finally:
            self._checked.set()
        exact = batch_invariant.BatchInvariant() if self.exact else contextlib.nullcontext()
        try:
            with torch.inference_mode(), exact:  # no autograd records on this thread: it only samples
                self._loop()
        except BaseException as exc:  # noqa: BLE001 - the engine is dead: every waiter hears why
            self.error = exc
            log.exception("event=engine_died error=%s", exc)
        finally:
            self._fail_all(self.error or RuntimeError("the torch engine was closed"))

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._closed or self._can_step()):
                    self._wake.wait()
                if self._closed:
                    return
                room = 0 if self._updates else self.max_num_seqs - len(self._live)
                admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            self._step([s for s in admitted if s.future.set_running_or_notify_cancel()])

    def _can_step(self) -> bool:
        """A waiting update goes first (a lock alone let this thread take it straight back)."""
        if self._broken:
            return False
        if self._updates:
            return self.update_mode == "between_requests" and bool(self._live)
        return bool(self._waiting or self._live)

    def _step(self, admitted: list[Seq]) -> None:
        with self._lock:
            for seq in self._live:
                if seq.future.aborted:
                    seq.finish = "abort"
            self._retire()
            if self._live:
                try:
                    if self._built_on != self._version:
                        self._recompute()  # in flight: the running sequences continue on the new weights
                    else:
                        self._decode()
                except Exception as exc:  # noqa: BLE001 - a failed forward: find the sequences it was
                    self._isolate(self._live, exc)
            if admitted:
                try:
                    self._admit(admitted)
                except Exception as exc:  # noqa: BLE001 - the same for the newcomers' prefill
                    self._isolate(admitted, exc)
            self._retire()
        self.steps += 1
        if self._updates:
            with self._wake:
                self._wake.notify_all()  # an update waiting for the running sequences to finish

    def _isolate(self, rows: list[Seq], exc: Exception) -> None:
        """A batch forward over `rows` failed: run each of them alone (a prefill of its prompt and
        tokens so far, and its next token), so only the sequences that fail alone fail; the others
        rejoin the running batch."""
        log.warning("event=step_failed sequences=%d error=%s: each sequence alone", len(rows), exc)
        if rows is self._live:
            self._live = []
            self._cache = None
            self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        for seq in rows:
            if seq.finish:
                continue
            try:
                self._admit([seq], seq.prompt + seq.tokens)
            except Exception as alone:  # noqa: BLE001 - this sequence fails, alone
                log.warning("event=sequence_failed error=%s", alone)
                seq.fail(alone)
                if not seq.future.done():
                    seq.future.set_exception(alone)

    def _admit(self, admitted: list[Seq], tokens: list[int] | None = None) -> None:
        """Prefill the newcomers (or one sequence again from `tokens`: its prompt and tokens so far)
        and sample their next token, then merge them into the running batch."""
        for seq in admitted:
            if seq.seed and seq.generator is None:
                seq.generator = torch.Generator(self.device).manual_seed(seq.seed)
            if tokens is not None and seq.trace:
                seq.positions.clear()
        logits, cache, mask = prefill(
            self.model,
            self.routing,
            self.activations,
            self.pad_token_id,
            admitted,
            [tokens] if tokens is not None else [s.prompt for s in admitted],
            self.device,
        )
        self._sample(admitted, logits)
        self._merge(admitted, cache, mask)

    def _recompute(self) -> None:
        """Prompt + tokens of every running sequence through the new weights: also its decode step."""
        rows = self._live
        for seq in rows:
            if seq.trace:
                seq.positions.clear()
        logits, self._cache, self._mask = prefill(
            self.model,
            self.routing,
            self.activations,
            self.pad_token_id,
            rows,
            [s.prompt + s.tokens for s in rows],
            self.device,
        )
        self._built_on = self._version
        self._sample(rows, logits)

    def _decode(self) -> None:
        rows = self._live
        input_ids = torch.tensor([[s.tokens[-1]] for s in rows], device=self.device)
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(rows), 1)], dim=1)
        positions = torch.tensor([[len(s.prompt) + len(s.tokens) - 1] for s in rows], device=self.device)
        logits, self._cache = forward(
            self.model,
            self.routing,
            self.activations,
            input_ids,
            self._mask,
            positions,
            self._cache,
            rows,
            [1] * len(rows),
        )
        self._sample(rows, logits)

    def _sample(self, rows: list[Seq], logits: torch.Tensor) -> None:
        if rows and self._version not in self.first_token_at:
            self.first_token_at[self._version] = time.time()
        sample_next(rows, logits, self._version, self.eos_token_ids)

    def _merge(self, rows: list[Seq], cache, mask: torch.Tensor) -> None:
        if not self._live:
            self._live = list(rows)
            self._cache = cache
            self._mask = mask
            self._built_on = self._version
            return
        self._mask = append_rows(self._cache, self._mask, cache, mask)
        self._live = self._live + list(rows)

    def _retire(self) -> None:
        """Resolve finished sequences and drop their rows (and columns no row uses any more)."""
        done = [s for s in self._live if s.finish]
        if not done:
            return
        keep = [i for i, s in enumerate(self._live) if not s.finish]
        for seq in done:
            if seq.future.done():
                continue
            if seq.error is not None:
                seq.future.set_exception(seq.error)
            else:
                seq.future.set_result(result_of(seq, self.routing.num_experts))
        self._live = [self._live[i] for i in keep]
        if not keep:
            self._cache = None
            self._mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
            return
        self._mask = keep_rows(self._cache, self._mask, keep)

    def _fail_all(self, exc: BaseException) -> None:
        with self._wake:
            waiting = list(self._waiting)
            self._waiting = collections.deque()
        for seq in [*self._live, *waiting]:
            if not seq.future.done() and (seq.future.running() or seq.future.set_running_or_notify_cancel()):
                seq.future.set_exception(exc)
        self._live = []
