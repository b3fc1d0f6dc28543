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
import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.engines.base import (
    Capabilities,
    OnToken,
    Sample,
    Sampling,
    StagedWeights,
    generate_all,
    processed_logprobs,
)
from shared.models import load_causal_lm
from shared.models.loading import resolve_dtype
from shared.models.quantization import (
    FORMATS,
    QUANTIZATIONS,
    QuantizedActivations,
    quantize_,
    quantized_targets,
)
from shared.models.routing import RoutingController
from shared.torch_threads import bind_torch_threads

log = logging.getLogger("steadyrl.engines.torch")
UPDATE_MODES = ("in_flight", "between_requests")


class _Future(concurrent.futures.Future):
    """A sequence's future; cancelling it while it runs aborts the sequence at the next step."""

    aborted = False

    def cancel(self) -> bool:
        self.aborted = True
        return super().cancel()


@dataclass(eq=False)
class _Seq:
    prompt: list[int]
    sampling: Sampling
    seed: int
    trace: bool
    on_token: OnToken | None
    future: _Future
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)  # routing of each fed position [L, K]
    finish: str = ""


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
        self.quantized = quantized_targets(self.model, quantize_router) if quantization != "none" else []
        quantize_(self.model, self.quantized, quantization)
        params = dict(self.model.named_parameters())  # loads copy into these tensors: their storage stays
        self.activations = (QuantizedActivations([params[n] for n in self.quantized], quantization)
                            if quantize_activations else contextlib.nullcontext())
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(getattr(config, "max_position_embeddings", 4096))
        eos = config.eos_token_id
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
        self.pad_token_id = int(getattr(config, "pad_token_id", None) or 0)
        notes = (f"{FORMATS.get(quantization, '')}{', and their inputs, per-token scales' if quantize_activations else ''}"
                 f", emulated: {len(self.quantized)} tensors rounded through {quantization}, "
                 f"computed in {str(self.dtype).removeprefix('torch.')}"
                 f"{' (router included)' if quantize_router else ' (router not)'}",) if self.quantized else ()
        self.capabilities = Capabilities(routing_trace=self.routing.is_moe, dtype=str(self.dtype).removeprefix("torch."),
                                         notes=(*notes, f"on {self.device}") if self.device.type != "cpu" else notes)
        self._init_weights(version)
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._live: list[_Seq] = []
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
        self._check(prompt, sampling, return_trace)
        seq = _Seq(list(prompt), sampling, sampling.seed + index if sampling.seed else 0, return_trace, on_token,
                   _Future())
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

    def _check(self, prompt: list[int], sampling: Sampling, return_trace: bool) -> None:
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        if return_trace and not self.capabilities.routing_trace:
            raise ValueError("this model has no MoE router: no routing trace to return")
        if len(prompt) + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({sampling.max_new_tokens}) > {self.max_model_len}")

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
    def _step(self, admitted: list[_Seq]) -> None:
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

    def _forward(self, input_ids, attention, positions, cache, rows: list[_Seq], fed: list[int]):
        """One forward; returns the logits of each row's last position. With traces, `fed[i]`
        positions of row i (its last ones) get the routing this forward used."""
        tracing = any(s.trace for s in rows)
        capture = self.routing.capture() if tracing else None
        recording = capture.__enter__() if capture is not None else None
        try:
            with self.activations:
                out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                                 past_key_values=cache, use_cache=True)
        finally:
            if capture is not None:
                capture.__exit__(None, None, None)
        if recording is not None and recording.calls:
            routed = torch.stack(recording.calls[-1], dim=1)  # [B * W, L, K]
            routed = routed.reshape(len(rows), input_ids.shape[1], *routed.shape[1:]).cpu().numpy()
            for row, (seq, count) in enumerate(zip(rows, fed, strict=True)):
                if seq.trace:
                    seq.positions.extend(routed[row, input_ids.shape[1] - count :])
        return out.logits[:, -1, :], out.past_key_values

    def _prefill(self, rows: list[_Seq], sequences: list[list[int]]):
        """Left-padded forward of whole sequences from scratch: (last logits, cache, mask)."""
        width = max(map(len, sequences))
        pads = torch.tensor([width - len(s) for s in sequences], device=self.device)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(s)) + list(s) for s in sequences],
                                 device=self.device)
        mask = (torch.arange(width, device=self.device)[None, :] >= pads[:, None]).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(input_ids, mask, positions, None, rows, [len(s) for s in sequences])
        return logits, cache, mask

    def _admit(self, admitted: list[_Seq]) -> None:
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

    def _sample(self, rows: list[_Seq], logits: torch.Tensor) -> None:
        version = self._version
        if rows and version not in self.first_token_at:
            self.first_token_at[version] = time.time()
        groups: dict[Sampling, list[int]] = collections.defaultdict(list)
        for row, seq in enumerate(rows):
            groups[seq.sampling].append(row)
        for sampling, members in groups.items():  # the distribution once per sampling setting
            logp = processed_logprobs(logits[members], sampling)
            if sampling.temperature > 0:
                probs = logp.exp()
                drawn = torch.multinomial(probs, 1).squeeze(-1)  # unseeded rows: one draw for all of them
                for i, row in enumerate(members):  # a seeded row draws from its own generator
                    if rows[row].generator is not None:
                        drawn[i] = torch.multinomial(probs[i], 1, generator=rows[row].generator)[0]
            else:
                drawn = logp.argmax(-1)
            picked = logp.gather(-1, drawn[:, None]).squeeze(-1).tolist()  # one copy to the host each
            chosen = drawn.tolist()
            for row, token, logprob in zip(members, chosen, picked, strict=True):
                seq = rows[row]
                seq.tokens.append(token)
                seq.logprobs.append(logprob)
                seq.versions.append(version)
                if seq.on_token is not None:
                    seq.on_token(token, logprob, version)
                if (token in self.eos_token_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids:
                    seq.finish = "stop"
                elif len(seq.tokens) >= sampling.max_new_tokens:
                    seq.finish = "length"

    def _merge(self, rows: list[_Seq], cache, mask: torch.Tensor) -> None:
        """Append `rows` (their cache and mask) to the running batch, left-padding whichever is
        narrower so every row's last position lines up."""
        if not self._live:
            self._live, self._cache, self._mask, self._built_on = list(rows), cache, mask, self._version
            return
        width = max(self._mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)], dim=0)
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)], dim=0)
        self._mask = torch.cat([_left_pad_mask(self._mask, width), _left_pad_mask(mask, width)], dim=0)
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
        index = torch.tensor(keep, device=self.device)
        mask = self._mask[index]
        first = int(mask.any(0).nonzero()[0])
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]
        self._mask = mask[:, first:]

    def _empty_mask(self) -> torch.Tensor:
        return torch.zeros(0, 0, dtype=torch.long, device=self.device)

    def _result(self, seq: _Seq) -> Sample:
        sample = Sample(seq.tokens, seq.logprobs, seq.versions, seq.finish)
        if seq.trace:  # P + C − 1 positions: every token fed, the last one never is
            trace = np.stack(seq.positions[: len(seq.prompt) + len(seq.tokens) - 1])
            sample.routing_trace = trace.astype(np.uint16 if self.routing.num_experts > 256 else np.uint8)
            sample.num_experts = self.routing.num_experts
        return sample

    def _fail_all(self, exc: BaseException) -> None:
        with self._wake:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for seq in [*self._live, *waiting]:
            if not seq.future.done() and (seq.future.running() or seq.future.set_running_or_notify_cancel()):
                seq.future.set_exception(exc)
        self._live = []


def _left_pad(states: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - states.shape[-2]
    if missing == 0:
        return states
    pad = states.new_zeros(*states.shape[:-2], missing, states.shape[-1])
    return torch.cat([pad, states], dim=-2)


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    return mask if missing == 0 else torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)
