"""The reference engine: a transformers causal LM with continuous batching on a thread of its own.

Sequences enter as they are submitted (`start`) and leave as they finish: at each decode step the
engine admits waiting prompts into free slots (a left-padded prefill of the newcomers whose KV is
merged into the running batch's cache, left-padded to a common width), samples one token for
every running sequence, and drops the finished ones (their futures resolve then). Per-row
position ids and the attention mask keep every row's logprobs those of a fresh full forward.

Weights: a version staged by `update_weights` lands between two steps. `update_mode =
"in_flight"`: running sequences continue on it, their KV recomputed under the new weights (one
prefill of prompt + tokens so far), so every token's logprob is that of the version recorded
for it over the whole prefix. `"between_requests"`: admissions stop while a version waits, the
running sequences finish on the old weights, then it is applied: every rollout is one version.

Routing traces come from capturing the routers during the very forwards that sample (a
recomputation after an update replaces the trace of the positions it recomputed).

Device: the CPU, or a GPU (`device="cuda"`: the replica's first visible GPU, which `steadyrl run`
gives it with `inference.gpus_per_replica = 1`); the same code either way. Seeded sampling draws
from a generator on the engine's device, so a seed gives the same tokens on the same device.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import logging
import threading
import time
import weakref

import torch

from shared.engines.base import (
    Capabilities,
    OnToken,
    Sample,
    Sampling,
    StagedWeights,
    check_request,
    generate_all,
)
from shared.engines.sequences import (
    Seq,
    SeqFuture,
    append_rows,
    forward,
    keep_rows,
    result_of,
    sample_next,
)
from shared.models import load_causal_lm
from shared.models.loading import resolve_dtype
from shared.models.quantization import QUANTIZATIONS, emulate, quantize_
from shared.models.routing import RoutingController
from shared.torch_threads import bind_torch_threads

log = logging.getLogger("steadyrl.engines.torch")
UPDATE_MODES = ("in_flight", "between_requests")


def _close_at_exit(engine: weakref.ref) -> None:
    alive = engine()
    if alive is not None:
        alive.close()


class TorchEngine(StagedWeights):
    name = "torch"

    def __init__(self, model_path: str, dtype: str = "float32", version: int = 0, threads: int = 0,
                 max_num_seqs: int = 256, update_mode: str = "in_flight", quantization: str = "none",
                 quantize_router: bool = False, quantize_activations: bool = False, device: str = "cpu") -> None:
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"update_mode must be one of {UPDATE_MODES}, got {update_mode!r}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        for name, asked in (("quantize_router", quantize_router), ("quantize_activations", quantize_activations)):
            if asked and quantization == "none":  # as InferenceSettings refuses it
                raise ValueError(f'{name} needs a quantization ("fp8" or "fp4")')
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"the torch engine was asked for {device} and no CUDA device is visible")
        self.threads, self.max_num_seqs, self.update_mode = threads, max_num_seqs, update_mode
        self.model_path = str(model_path)
        self.dtype = resolve_dtype(dtype)
        self.model = load_causal_lm(model_path, self.dtype, self.device).eval()
        self.routing = RoutingController(self.model)
        self.quantization = quantization
        self.quantized, self.activations, notes = emulate(self.model, quantization, quantize_router,
                                                          quantize_activations, self.dtype)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(getattr(config, "max_position_embeddings", 4096))
        eos = config.eos_token_id
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
        self.pad_token_id = int(getattr(config, "pad_token_id", None) or 0)
        self.capabilities = Capabilities(routing_trace=self.routing.is_moe, dtype=str(self.dtype).removeprefix("torch."),
                                         notes=(*notes, f"on {self.device}") if self.device.type != "cpu" else notes)
        self._init_weights(version)
        self._waiting: collections.deque[Seq] = collections.deque()
        self._live: list[Seq] = []
        self._cache = None  # the running batch's KV cache, rows in `_live` order
        self._mask = self._empty_mask()
        self._built_on = version  # the weights the cache was computed with
        self._wake = threading.Condition()
        self._closed = False
        self.error: BaseException | None = None  # why the engine thread died, if it did
        self.steps = 0
        self.first_token_at: dict[int, float] = {}  # wall time of the first token each version produced
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()
        # an engine nobody closed stops before the interpreter does: a daemon thread cut off inside
        # torch at exit aborts the process ("terminate called without an active exception")
        atexit.register(_close_at_exit, weakref.ref(self))

    # --- the public side ---------------------------------------------------------------------------

    generate = generate_all

    def start(self, prompt: list[int], sampling: Sampling, return_trace: bool = False,
              on_token: OnToken | None = None, index: int = 0) -> concurrent.futures.Future:
        """Queue one sequence; its Sample arrives on the future. Seeded sampling uses `seed +
        index`, so a group's samples differ and none depends on what else runs."""
        check_request(prompt, sampling, return_trace, self.max_model_len,
                      None if self.capabilities.routing_trace else "this model has no MoE router: no routing trace to return")
        seq = Seq(list(prompt), sampling, sampling.seed + index if sampling.seed else 0, return_trace, on_token,
                   SeqFuture())
        with self._wake:
            if self._closed or self.error is not None:
                raise RuntimeError(f"the torch engine is stopped{f': {self.error}' if self.error else ''}")
            self._waiting.append(seq)
            self._wake.notify()
        return seq.future

    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> float:
        seconds = super().update_weights(version, state_dict)
        with self._wake:
            self._wake.notify()  # a version waiting for the running sequences to drain
        return seconds

    @property
    def running(self) -> int:
        return len(self._live)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(30)
        self.routing.close()

    # --- weights -----------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise KeyError(f"weights of version {version} do not fit the model: "
                           f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        quantize_(self.model, [name for name in self.quantized if name in state_dict], self.quantization)

    def _may_apply(self) -> bool:
        return self.update_mode == "in_flight" or not self._live

    # --- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        bind_torch_threads(self.threads)
        try:
            while True:
                with self._wake:
                    while not (self._closed or self._waiting or self._live or self._applicable()):
                        self._wake.wait()
                    if self._closed:
                        break
                    draining = self.update_mode == "between_requests" and self._pending is not None
                    room = 0 if draining else self.max_num_seqs - len(self._live)
                    admitted = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                self._step([s for s in admitted if s.future.set_running_or_notify_cancel()])
        except BaseException as exc:  # noqa: BLE001 - the engine is dead: every waiter hears why
            self.error = exc
            log.exception("event=engine_died error=%s", exc)
        finally:
            self._fail_all(self.error or RuntimeError("the torch engine was closed"))

    def _applicable(self) -> bool:
        return self._pending is not None and self._may_apply()

    @torch.no_grad()
    def _step(self, admitted: list[Seq]) -> None:
        with self._lock:
            if self._may_apply():
                self._apply_pending()
            for seq in self._live:
                if seq.future.aborted:
                    seq.finish = "abort"
            self._retire()
            try:
                if self._live and self._built_on != self._version:
                    self._recompute()  # in flight: the running sequences continue on the new weights
                elif self._live:
                    self._decode()
                if admitted:
                    self._admit(admitted)
            except Exception as exc:  # noqa: BLE001 - a failed forward fails its sequences, not the engine
                log.exception("event=step_failed sequences=%d error=%s", len(self._live) + len(admitted), exc)
                for seq in [*self._live, *admitted]:
                    if not seq.future.done():
                        seq.future.set_exception(exc)
                self._live, self._cache = [], None
                return
            self._retire()
        self.steps += 1
        self._drain()

    def _forward(self, input_ids, attention, positions, cache, rows: list[Seq], fed: list[int]):
        """One forward; returns the logits of each row's last position and the cache."""
        return forward(self.model, self.routing, self.activations, input_ids, attention, positions, cache, rows, fed)

    def _prefill(self, rows: list[Seq], sequences: list[list[int]]):
        """Left-padded forward of whole sequences from scratch: (last logits, cache, mask)."""
        width = max(map(len, sequences))
        pads = torch.tensor([width - len(s) for s in sequences], device=self.device)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(s)) + list(s) for s in sequences],
                                 device=self.device)
        mask = (torch.arange(width, device=self.device)[None, :] >= pads[:, None]).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(input_ids, mask, positions, None, rows, [len(s) for s in sequences])
        return logits, cache, mask

    def _admit(self, admitted: list[Seq]) -> None:
        for seq in admitted:
            if seq.seed:
                seq.generator = torch.Generator(self.device).manual_seed(seq.seed)
        logits, cache, mask = self._prefill(admitted, [s.prompt for s in admitted])
        self._sample(admitted, logits)
        self._merge(admitted, cache, mask)

    def _recompute(self) -> None:
        """Every running sequence's prompt and tokens through the new weights at once; the last
        token was not fed yet, so this is its decode step too."""
        rows = self._live
        for seq in rows:
            if seq.trace:
                seq.positions.clear()
        logits, self._cache, self._mask = self._prefill(rows, [s.prompt + s.tokens for s in rows])
        self._built_on = self._version
        self._sample(rows, logits)

    def _decode(self) -> None:
        rows = self._live
        input_ids = torch.tensor([[s.tokens[-1]] for s in rows], device=self.device)
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(rows), 1)], dim=1)
        positions = torch.tensor([[len(s.prompt) + len(s.tokens) - 1] for s in rows], device=self.device)
        logits, self._cache = self._forward(input_ids, self._mask, positions, self._cache, rows, [1] * len(rows))
        self._sample(rows, logits)

    def _sample(self, rows: list[Seq], logits: torch.Tensor) -> None:
        if rows and self._version not in self.first_token_at:
            self.first_token_at[self._version] = time.time()
        sample_next(rows, logits, self._version, self.eos_token_ids)

    def _merge(self, rows: list[Seq], cache, mask: torch.Tensor) -> None:
        """Append `rows` (their cache and mask) to the running batch."""
        if not self._live:
            self._live, self._cache, self._mask, self._built_on = list(rows), cache, mask, self._version
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
            if not seq.future.done():
                seq.future.set_result(self._result(seq))
        self._live = [self._live[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, self._empty_mask()
            return
        self._mask = keep_rows(self._cache, self._mask, keep)

    def _empty_mask(self) -> torch.Tensor:
        return torch.zeros(0, 0, dtype=torch.long, device=self.device)

    def _result(self, seq: Seq) -> Sample:
        return result_of(seq, self.routing.num_experts)

    def _fail_all(self, exc: BaseException) -> None:
        with self._wake:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for seq in [*self._live, *waiting]:
            if not seq.future.done() and (seq.future.running() or seq.future.set_running_or_notify_cancel()):
                seq.future.set_exception(exc)
        self._live = []
