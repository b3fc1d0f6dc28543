"""The torch engine's running sequences: each one's state, the sampling of its next token, and
the batch's KV cache — rows appended left-padded to a common width, finished rows dropped with
the columns no row uses any more."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.engines.base import OnToken, Sample, Sampling, processed_logprobs
from shared.engines.seq_future import SeqFuture


@dataclass(eq=False)
class Seq:
    prompt: list[int]
    sampling: Sampling
    seed: int
    trace: bool
    on_token: OnToken | None
    future: SeqFuture
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    positions: list[np.ndarray] = field(
        default_factory=list
    )  # routing of the fed positions, a chunk [n, L, K] a forward
    finish: str = ""  # stop | length | abort | error
    error: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        """This sequence ends with `exc` (its future raises it once the engine retires it)."""
        self.finish = "error"
        self.error = exc


def sample_next(rows: list[Seq], logits: torch.Tensor, version: int, eos_token_ids: tuple[int, ...]) -> None:
    """One token for every row from its last logits ([rows, vocab]), recorded with its logprob and
    `version`; a row that stops (EOS, a stop token, max_new_tokens) gets its `finish`. A row whose
    sampling or `on_token` raises gets `finish = "error"` and the exception, the other rows go on."""
    groups: dict[Sampling, list[int]] = collections.defaultdict(list)
    for row, seq in enumerate(rows):
        groups[seq.sampling].append(row)
    for sampling, members in groups.items():  # the distribution once per sampling setting
        try:
            drawn = _draw(rows, members, logits, sampling)
        except Exception:  # noqa: BLE001 - one row's failure must not fail the others: each alone
            drawn = []
            for row in members:
                try:
                    drawn.append(_draw(rows, [row], logits, sampling))
                except Exception as exc:  # noqa: BLE001 - this row fails, named
                    rows[row].fail(exc)
                    drawn.append(None)
        else:
            drawn = [drawn[i : i + 1] for i in range(len(members))]
        for row, picked in zip(members, drawn, strict=True):
            if picked is not None:
                _record(rows[row], *picked[0], version, eos_token_ids)


def _draw(rows: list[Seq], members: list[int], logits: torch.Tensor, sampling: Sampling) -> list[tuple[int, float]]:
    """(token, logprob) for each of `members`, drawn from `sampling`'s distribution by inverting
    its CDF at a uniform draw (one `rand` for the batch: ten times cheaper than `multinomial` per
    row on a CPU); a seeded row draws its uniform from its own generator."""
    logp = processed_logprobs(logits if len(members) == logits.shape[0] else logits[members], sampling)
    if sampling.temperature > 0:
        cdf = logp.exp().cumsum(-1)
        uniform = torch.rand(len(members), 1, device=logp.device)
        for i, row in enumerate(members):
            if rows[row].generator is not None:
                uniform[i] = torch.rand(1, generator=rows[row].generator, device=logp.device)
        # the first token whose cumulative mass exceeds u: never one of zero probability
        drawn = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(-1)
    else:
        drawn = logp.argmax(-1)
    picked = logp.gather(-1, drawn[:, None]).squeeze(-1).tolist()  # one copy to the host each
    if not all(math.isfinite(p) for p in picked):
        raise ValueError("a sampled token has a non-finite logprob")
    return list(zip(drawn.tolist(), picked, strict=True))


def _record(seq: Seq, token: int, logprob: float, version: int, eos_token_ids: tuple[int, ...]) -> None:
    seq.tokens.append(token)
    seq.logprobs.append(logprob)
    seq.versions.append(version)
    if seq.on_token is not None:
        try:
            seq.on_token(token, logprob, version)
        except Exception as exc:  # noqa: BLE001 - the caller's callback fails its own sequence only
            seq.fail(exc)
            return
    sampling = seq.sampling
    if (token in eos_token_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids:
        seq.finish = "stop"
    elif len(seq.tokens) >= sampling.max_new_tokens:
        seq.finish = "length"


def forward(model, routing, activations, input_ids, attention, positions, cache, rows: list[Seq], fed: list[int]):
    """One forward of the batch; returns the logits of each row's last position and the cache.
    With traces, `fed[i]` positions of row i (its last ones) get the routing this forward used."""
    tracing = any(s.trace for s in rows)
    capture = routing.capture() if tracing else None
    recording = capture.__enter__() if capture is not None else None
    try:
        with activations:
            out = model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
    finally:
        if capture is not None:
            capture.__exit__(None, None, None)
    if recording is not None and recording.calls:
        routed = torch.stack(recording.calls[-1], dim=1)  # [B * W, L, K]
        routed = routed.reshape(len(rows), input_ids.shape[1], *routed.shape[1:]).cpu().numpy()
        for row, (seq, count) in enumerate(zip(rows, fed, strict=True)):
            if seq.trace:
                seq.positions.append(routed[row, input_ids.shape[1] - count :])
    return out.logits[:, -1, :], out.past_key_values


def prefill(
    model, routing, activations, pad_token_id: int, rows: list[Seq], sequences: list[list[int]], device: torch.device
):
    """Left-padded forward of whole sequences from scratch: (last logits, cache, mask). Equal
    sequences (a group's G samples of one prompt) are computed once and the row copied: the same
    logits, cache and routing at a fraction of the forward."""
    copies: dict[tuple[int, ...], list[int]] = {}
    for i, sequence in enumerate(sequences):
        copies.setdefault(tuple(sequence), []).append(i)
    if len(copies) == len(sequences):
        return _prefill(model, routing, activations, pad_token_id, rows, sequences, device)
    members = list(copies.values())
    # each distinct sequence once, fed by a row that wants the routing when one of its copies does
    computed = [next((rows[i] for i in m if rows[i].trace), rows[m[0]]) for m in members]
    logits, cache, mask = _prefill(
        model, routing, activations, pad_token_id, computed, [sequences[m[0]] for m in members], device
    )
    source = [0] * len(sequences)
    for u, m in enumerate(members):
        for i in m:
            source[i] = u
            if rows[i] is not computed[u] and rows[i].trace:
                rows[i].positions.append(computed[u].positions[-1])  # this prefill's chunk: the same sequence
    pick = torch.tensor(source, device=device)
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, pick)
        layer.values = layer.values.index_select(0, pick)
    return logits.index_select(0, pick), cache, mask.index_select(0, pick)


def _prefill(
    model, routing, activations, pad_token_id: int, rows: list[Seq], sequences: list[list[int]], device: torch.device
):
    width = max(map(len, sequences))
    pads = torch.tensor([width - len(s) for s in sequences], device=device)
    input_ids = torch.tensor([[pad_token_id] * (width - len(s)) + list(s) for s in sequences], device=device)
    mask = (torch.arange(width, device=device)[None, :] >= pads[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, cache = forward(
        model, routing, activations, input_ids, mask, positions, None, rows, [len(s) for s in sequences]
    )
    return logits, cache, mask


def result_of(seq: Seq, num_experts: int) -> Sample:
    """A finished sequence as a Sample; its trace covers P + C − 1 positions: every token fed, the
    last one never is."""
    sample = Sample(seq.tokens, seq.logprobs, seq.versions, seq.finish)
    if seq.trace:
        trace = np.concatenate(seq.positions)[: len(seq.prompt) + len(seq.tokens) - 1]
        sample.routing_trace = trace.astype(np.uint16 if num_experts > 256 else np.uint8)
        sample.num_experts = num_experts
    return sample


def append_rows(cache, mask: torch.Tensor, other, other_mask: torch.Tensor) -> torch.Tensor:
    """Append `other`'s rows to `cache` (in place), left-padding the narrower so every row's last
    position lines up; returns the batch's mask."""
    width = max(mask.shape[1], other_mask.shape[1])
    for mine, theirs in zip(cache.layers, other.layers, strict=True):
        mine.keys = torch.cat([left_pad(mine.keys, width), left_pad(theirs.keys, width)], dim=0)
        mine.values = torch.cat([left_pad(mine.values, width), left_pad(theirs.values, width)], dim=0)
    return torch.cat([left_pad_mask(mask, width), left_pad_mask(other_mask, width)], dim=0)


def keep_rows(cache, mask: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """Only the rows `keep` of `cache` (in place), without the columns none of them uses; returns their mask."""
    index = torch.tensor(keep, device=mask.device)
    mask = mask[index]
    first = int(mask.any(0).nonzero()[0])
    for layer in cache.layers:
        layer.keys = layer.keys[index, :, first:]
        layer.values = layer.values[index, :, first:]
    return mask[:, first:]


def left_pad(states: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - states.shape[-2]
    if missing == 0:
        return states
    pad = states.new_zeros(*states.shape[:-2], missing, states.shape[-1])
    return torch.cat([pad, states], dim=-2)


def left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    return mask if missing == 0 else torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)
