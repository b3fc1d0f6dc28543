"""The Rollout record: one sampled response, its inference logprobs, versions and routing trace.

`encode_rollout` / `decode_rollout` are the wire codec (protobuf `steadyrl.v1.Rollout`, never
pickle); `validate_rollout` rejects what the trainer must not train on. Every failure of either is
a `RolloutError` whose `reason` is a short stable code (used as the dead-letter reason and as a
metric label) and whose message says what was wrong.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np
import zstandard
from google.protobuf.message import DecodeError

from shared.rpc.steadyrl.v1 import rollout_pb2

# Slack for logprobs computed in low precision: a logprob above this is not a probability.
MAX_LOGPROB = 1e-3
# A logprob below this is no model's (a float32 log-softmax stays within a few hundred of 0); one that
# low would overflow the ratios and KL estimates the loss forms from it.
MIN_LOGPROB = -1e4
# The largest |reward| the trainer takes: a group's sum and mean stay far inside float32, the loss's dtype.
MAX_REWARD = 1e6
_TRACE_DTYPES = {rollout_pb2.RoutingTrace.UINT8: np.uint8, rollout_pb2.RoutingTrace.UINT16: np.uint16}
_WIRE_DTYPES = {k: np.dtype(v).newbyteorder("<") for k, v in _TRACE_DTYPES.items()}  # a trace's bytes: little-endian
_MAX_TRACE_BYTES = 1 << 31  # an unpacked trace (a 256k-token rollout of a 48-layer top-8 model is ~100 MB)
SOURCE_NAME = re.compile(r"[a-z0-9_]{0,64}")  # a mixture source's name (a metric key of the trainer), or empty


def _unzstd() -> zstandard.ZstdDecompressor:
    return zstandard.ZstdDecompressor()  # one per call, as the compressor: neither is thread-safe


class RolloutError(ValueError):
    """A rollout that cannot be decoded or must not be trained on."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass
class RolloutTimings:
    leased_unix_ms: int = 0
    started_unix_ms: int = 0
    finished_unix_ms: int = 0
    generation_seconds: float = 0.0


@dataclass
class Rollout:
    """One response y to prompt x. Arrays: token ids int32 [P] / [C], inference_logprobs float32 [C],
    policy_versions uint64 [C] (the version that sampled each token), routing_trace uint8/uint16
    [P + C − 1, layers, top_k] or None, loss_mask bool [C] or None. A multi-turn trajectory's
    completion interleaves the model's turns with the environment's observations: `loss_mask`
    marks the model's tokens (the only ones trained, Eq. 7 summing over them alone); the
    environment's carry logprob 0 and the version of the model turn before them."""

    rollout_id: str
    group_id: str
    prompt_token_ids: np.ndarray
    completion_token_ids: np.ndarray
    inference_logprobs: np.ndarray
    policy_versions: np.ndarray
    reward: float
    sample_index: int = 0
    group_size: int = 1
    run_id: str = ""
    task_id: str = ""
    routing_trace: np.ndarray | None = None
    num_experts: int = 0
    finish_reason: str = ""
    replica_id: str = ""
    engine: str = ""
    is_eval: bool = False
    timings: RolloutTimings = field(default_factory=RolloutTimings)
    loss_mask: np.ndarray | None = None
    turns: int = 0  # model turns of a multi-turn trajectory
    env_metrics: dict[str, float] = field(default_factory=dict)  # the environment's counts, summed over its steps
    reward_error: str = ""  # why the reward could not score it (then 0); empty when it did
    source: str = ""  # its task's data mixture source (empty: a run of one source)
    teacher_logprobs: np.ndarray | None = None  # float32 [C]: a teacher pool's logprob of each completion token
    reference_reward: float | None = None  # a judged reward's rule reward for the same completion (agreement)
    teacher_top_ids: np.ndarray | None = None  # int32 [C, k]: the teacher's k most likely tokens at each position
    teacher_top_logprobs: np.ndarray | None = None  # float32 [C, k]: their logprobs (most likely first)

    @property
    def model_tokens(self) -> np.ndarray:
        """bool [C]: which completion tokens the model sampled (all of them without a loss mask)."""
        if self.loss_mask is None:
            return np.ones(len(self.completion_token_ids), dtype=bool)
        return np.asarray(self.loss_mask, dtype=bool)

    @property
    def num_positions(self) -> int:
        """Positions a routing trace covers: prompt + completion − 1."""
        return len(self.prompt_token_ids) + len(self.completion_token_ids) - 1

    @property
    def min_version(self) -> int:
        """The oldest version that sampled a model token."""
        versions = np.asarray(self.policy_versions)[self.model_tokens] if len(self.policy_versions) else []
        return int(np.min(versions)) if len(versions) else 0


@dataclass(frozen=True)
class RolloutLimits:
    """What a valid rollout may hold. None = not checked."""

    max_encoded_bytes: int = 64 * 1024 * 1024
    max_total_tokens: int = 131072
    vocab_size: int | None = None
    num_layers: int | None = None
    top_k: int | None = None
    num_experts: int | None = None
    max_version: int | None = None
    """Newest policy version that exists (the trainer's); a later one is from the future."""


def encode_rollout(rollout: Rollout) -> bytes:
    msg = rollout_pb2.Rollout(
        rollout_id=rollout.rollout_id,
        run_id=rollout.run_id,
        task_id=rollout.task_id,
        group_id=rollout.group_id,
        sample_index=rollout.sample_index,
        group_size=rollout.group_size,
        prompt_token_ids=np.asarray(rollout.prompt_token_ids, dtype=np.int32).tolist(),
        completion_token_ids=np.asarray(rollout.completion_token_ids, dtype=np.int32).tolist(),
        inference_logprobs=np.asarray(rollout.inference_logprobs, dtype=np.float32).tolist(),
        policy_versions=np.asarray(rollout.policy_versions, dtype=np.uint64).tolist(),
        reward=float(rollout.reward),
        finish_reason=rollout.finish_reason,
        replica_id=rollout.replica_id,
        engine=rollout.engine,
        is_eval=rollout.is_eval,
        timings=rollout_pb2.RolloutTimings(**vars(rollout.timings)),
        loss_mask=np.asarray(rollout.loss_mask, dtype=bool).tolist() if rollout.loss_mask is not None else [],
        turns=rollout.turns,
        env_metrics=rollout.env_metrics,
        reward_error=rollout.reward_error,
        source=rollout.source,
        teacher_logprobs=(
            np.asarray(rollout.teacher_logprobs, dtype=np.float32).tolist()
            if rollout.teacher_logprobs is not None
            else []
        ),
        reference_reward=rollout.reference_reward,
    )
    if rollout.routing_trace is not None:
        msg.routing_trace.CopyFrom(trace_message(rollout.routing_trace, rollout.num_experts))
    if rollout.teacher_top_ids is not None and rollout.teacher_top_logprobs is not None:
        ids = np.asarray(rollout.teacher_top_ids, dtype=np.int32)
        msg.teacher_top.CopyFrom(
            rollout_pb2.TeacherTop(
                k=ids.shape[-1] if ids.ndim == 2 else 0,
                token_ids=ids.ravel().tolist(),
                logprobs=np.asarray(rollout.teacher_top_logprobs, dtype=np.float32).ravel().tolist(),
            )
        )
    return msg.SerializeToString()


def trace_message(routing_trace: np.ndarray, num_experts: int) -> rollout_pb2.RoutingTrace:
    """A trace on the wire: each id in the smallest type that holds the model's experts (one byte
    up to 256, whatever type the engine produced), then one zstd frame of the bytes when smaller
    (level 1: ~0.5 GB/s; 384 → 336 B per token for uniformly random top-8 of 128 over 48 layers,
    less as routing repeats from one token to the next)."""
    trace = np.ascontiguousarray(routing_trace)
    if trace.ndim != 3:
        raise RolloutError("trace_shape", f"routing trace must be [positions, layers, top_k], got {trace.shape}")
    largest = num_experts or (int(trace.max()) + 1 if trace.size else 0)
    wide = largest > 256
    raw = trace.astype("<u2" if wide else np.uint8).tobytes()
    packed = zstandard.ZstdCompressor(level=1).compress(raw) if len(raw) >= 64 else raw
    return rollout_pb2.RoutingTrace(
        dtype=rollout_pb2.RoutingTrace.UINT16 if wide else rollout_pb2.RoutingTrace.UINT8,
        num_positions=trace.shape[0],
        num_layers=trace.shape[1],
        top_k=trace.shape[2],
        num_experts=num_experts,
        expert_ids=packed if len(packed) < len(raw) else raw,
        zstd=len(packed) < len(raw),
    )


def decode_rollout(data: bytes, limits: RolloutLimits | None = None) -> Rollout:
    """Parse wire bytes into a Rollout; any failure raises RolloutError (never anything else)."""
    limits = limits or RolloutLimits()
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RolloutError("decode", f"expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_encoded_bytes:
        raise RolloutError("oversize", f"{len(data)} bytes > limit {limits.max_encoded_bytes}")
    msg = rollout_pb2.Rollout()
    try:
        msg.ParseFromString(data if isinstance(data, bytes) else bytes(data))
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise RolloutError("decode", f"not a steadyrl.v1.Rollout: {exc}") from None
    trace = None
    num_experts = 0
    if msg.HasField("routing_trace"):
        trace, num_experts = decode_trace(msg.routing_trace)
    top_ids = top_logprobs = None
    if msg.HasField("teacher_top"):
        top_ids, top_logprobs = decode_teacher_top(msg.teacher_top)
    return Rollout(
        rollout_id=msg.rollout_id,
        run_id=msg.run_id,
        task_id=msg.task_id,
        group_id=msg.group_id,
        sample_index=msg.sample_index,
        group_size=msg.group_size,
        prompt_token_ids=_array(msg.prompt_token_ids, np.int32),
        completion_token_ids=_array(msg.completion_token_ids, np.int32),
        inference_logprobs=_array(msg.inference_logprobs, np.float32),
        policy_versions=_array(msg.policy_versions, np.uint64),
        reward=msg.reward,
        routing_trace=trace,
        num_experts=num_experts,
        finish_reason=msg.finish_reason,
        replica_id=msg.replica_id,
        engine=msg.engine,
        is_eval=msg.is_eval,
        timings=RolloutTimings(
            leased_unix_ms=msg.timings.leased_unix_ms,
            started_unix_ms=msg.timings.started_unix_ms,
            finished_unix_ms=msg.timings.finished_unix_ms,
            generation_seconds=msg.timings.generation_seconds,
        ),
        loss_mask=_array(msg.loss_mask, bool) if len(msg.loss_mask) else None,
        turns=msg.turns,
        env_metrics=dict(msg.env_metrics) if len(msg.env_metrics) else {},
        reward_error=msg.reward_error[:200],
        source=msg.source,
        teacher_logprobs=_array(msg.teacher_logprobs, np.float32) if len(msg.teacher_logprobs) else None,
        reference_reward=msg.reference_reward if msg.HasField("reference_reward") else None,
        teacher_top_ids=top_ids,
        teacher_top_logprobs=top_logprobs,
    )


def _array(field, dtype) -> np.ndarray:
    """A repeated field as an array (np.fromiter: a quarter of np.array's time on a short field)."""
    return np.fromiter(field, dtype, len(field))


def decode_teacher_top(top: rollout_pb2.TeacherTop) -> tuple[np.ndarray, np.ndarray]:
    """The teacher's top-k ids int32 [C, k] and logprobs float32 [C, k]; RolloutError when the two
    lists do not fill whole rows of k."""
    k, count = top.k, len(top.token_ids)
    if k < 1 or count % k or len(top.logprobs) != count:
        raise RolloutError("teacher_top", f"{count} ids and {len(top.logprobs)} logprobs do not fill rows of k = {k}")
    ids = np.array(top.token_ids, dtype=np.int32).reshape(-1, k)
    return ids, np.array(top.logprobs, dtype=np.float32).reshape(-1, k)


def decode_trace(trace: rollout_pb2.RoutingTrace) -> tuple[np.ndarray, int]:
    dtype = _TRACE_DTYPES.get(trace.dtype)
    if dtype is None:
        raise RolloutError("trace_dtype", f"routing trace dtype {trace.dtype} is not UINT8 or UINT16")
    shape = (trace.num_positions, trace.num_layers, trace.top_k)
    expected = shape[0] * shape[1] * shape[2] * np.dtype(dtype).itemsize
    data = trace.expert_ids
    if trace.zstd:  # never inflated past what the shape says: a bomb is refused, not unpacked
        if expected > _MAX_TRACE_BYTES:
            raise RolloutError(
                "trace_shape", f"routing trace shape {shape} needs {expected} bytes > {_MAX_TRACE_BYTES}"
            )
        try:  # read at most one byte past the shape's size, whatever size the frame declares
            with _unzstd().stream_reader(data) as reader:
                data = reader.read(expected + 1)
        except zstandard.ZstdError as exc:
            raise RolloutError(
                "trace_decompress", f"routing trace is not a zstd frame of {expected} bytes: {exc}"
            ) from None
    if len(data) != expected:
        raise RolloutError("trace_shape", f"routing trace holds {len(data)} bytes, shape {shape} needs {expected}")
    ids = np.frombuffer(data, dtype=_WIRE_DTYPES[trace.dtype]).astype(dtype)
    return ids.reshape(shape), trace.num_experts


def validate_rollout(rollout: Rollout, limits: RolloutLimits | None = None) -> Rollout:
    """Return the rollout unchanged if it may be trained on, else raise RolloutError."""
    limits = limits or RolloutLimits()
    if not rollout.rollout_id:
        raise RolloutError("missing_id", "rollout_id is empty")
    if not rollout.group_id:
        raise RolloutError("missing_id", f"rollout {rollout.rollout_id}: group_id is empty")
    if not SOURCE_NAME.fullmatch(rollout.source):
        raise RolloutError("source", f"source {rollout.source[:80]!r}: at most 64 lower-case letters, digits and _")
    if rollout.group_size < 1 or rollout.sample_index >= rollout.group_size:
        raise RolloutError("group", f"sample_index {rollout.sample_index} outside a group of {rollout.group_size}")
    prompt_len = len(rollout.prompt_token_ids)
    completion_len = len(rollout.completion_token_ids)
    if prompt_len == 0 or completion_len == 0:
        raise RolloutError("empty", f"prompt has {prompt_len} tokens, completion {completion_len}")
    if prompt_len + completion_len > limits.max_total_tokens:
        raise RolloutError("oversize", f"{prompt_len + completion_len} tokens > limit {limits.max_total_tokens}")
    optional = tuple(name for name in ("loss_mask", "teacher_logprobs") if getattr(rollout, name) is not None)
    for name in ("inference_logprobs", "policy_versions", *optional):
        if len(getattr(rollout, name)) != completion_len:
            raise RolloutError(
                "length", f"{name} has {len(getattr(rollout, name))} entries for {completion_len} completion tokens"
            )
    tokens = np.concatenate([rollout.prompt_token_ids, rollout.completion_token_ids]).astype(np.int64)
    if tokens.min() < 0 or (limits.vocab_size is not None and tokens.max() >= limits.vocab_size):
        raise RolloutError("token_range", f"token ids span [{tokens.min()}, {tokens.max()}], vocab {limits.vocab_size}")
    logprobs = np.asarray(rollout.inference_logprobs, dtype=np.float32)
    if not np.isfinite(logprobs).all():
        bad = int((~np.isfinite(logprobs)).sum())
        raise RolloutError("nonfinite_logprobs", f"{bad} of {completion_len} inference logprobs are NaN/inf")
    if logprobs.max() > MAX_LOGPROB or logprobs.min() < MIN_LOGPROB:
        raise RolloutError(
            "logprob_range",
            f"inference logprobs span [{float(logprobs.min()):.4g}, {float(logprobs.max()):.4g}], "
            f"not within [{MIN_LOGPROB:g}, 0]",
        )
    if rollout.teacher_logprobs is not None and not logprobs_valid(rollout.teacher_logprobs):
        raise RolloutError("teacher_logprobs", f"a teacher logprob is NaN, infinite or outside [{MIN_LOGPROB:g}, 0]")
    if rollout.teacher_top_ids is not None or rollout.teacher_top_logprobs is not None:
        _validate_teacher_top(rollout, limits)
    if rollout.reference_reward is not None and not reward_valid(rollout.reference_reward):
        raise RolloutError(
            "nonfinite_reward", f"reference_reward {rollout.reference_reward} is not within ±{MAX_REWARD:g}"
        )
    if not reward_valid(rollout.reward):
        raise RolloutError("nonfinite_reward", f"reward {rollout.reward} is not a float32 within ±{MAX_REWARD:g}")
    if not all(map(np.isfinite, rollout.env_metrics.values())):
        raise RolloutError("nonfinite_reward", f"env_metrics {rollout.env_metrics} are not all finite")
    if rollout.loss_mask is not None and not rollout.model_tokens.any():
        raise RolloutError("empty", "the loss mask marks no model token")
    versions = rollout.policy_versions
    if (versions[1:] < versions[:-1]).any():
        raise RolloutError("version_order", "per-token policy versions decrease along the completion")
    if limits.max_version is not None and int(versions.max()) > limits.max_version:
        raise RolloutError(
            "future_version", f"version {int(versions.max())} is newer than the latest {limits.max_version}"
        )
    if rollout.routing_trace is not None:
        _validate_trace(rollout, limits)
    return rollout


def reward_valid(value: float) -> bool:
    """Whether a reward, as the float32 the loss holds, is finite and at most MAX_REWARD in size."""
    return math.isfinite(value) and abs(value) <= MAX_REWARD


def logprobs_valid(values: np.ndarray) -> bool:
    """Whether logprobs, as float32, are all finite and within [MIN_LOGPROB, 0] (MAX_LOGPROB's slack)."""
    with np.errstate(over="ignore"):  # a value past float32 becomes inf: refused below
        values = np.asarray(values, dtype=np.float32)
    return bool(
        values.size == 0 or (np.isfinite(values).all() and values.min() >= MIN_LOGPROB and values.max() <= MAX_LOGPROB)
    )


def _validate_teacher_top(rollout: Rollout, limits: RolloutLimits) -> None:
    """The teacher's top-k: ids and logprobs both, [C, k] each, and `top_k_problem`'s checks."""
    ids, logprobs = rollout.teacher_top_ids, rollout.teacher_top_logprobs
    if ids is None or logprobs is None:
        raise RolloutError("teacher_top", "the teacher's top-k needs both its token ids and their logprobs")
    completion_len = len(rollout.completion_token_ids)
    if ids.ndim != 2 or ids.shape != logprobs.shape or ids.shape[0] != completion_len or ids.shape[1] < 1:
        raise RolloutError(
            "teacher_top", f"top-k ids {ids.shape} and logprobs {logprobs.shape}, expected ({completion_len}, k)"
        )
    problem = top_k_problem(ids, logprobs, limits.vocab_size)
    if problem:
        raise RolloutError("teacher_top", problem.split(": ", 1)[1])


def top_k_problem(ids: np.ndarray, logprobs: np.ndarray, vocab_size: int | None) -> str:
    """Why a teacher's top-k rows ([C, k] ids and logprobs) cannot be trained on ('' when they can),
    `code: detail`: ids in the vocabulary and distinct in a row, logprobs as float32 finite and within
    [MIN_LOGPROB, 0], each row's probabilities summing to at most 1 (1 % slack). The replica's pool
    client and the trainer ask the same."""
    if ids.size and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
        return f"top_k_ids: top-k token ids span [{ids.min()}, {ids.max()}], vocabulary {vocab_size}"
    if ids.shape[1] > 1 and (np.diff(np.sort(ids, axis=1), axis=1) == 0).any():
        return "top_k_ids: a top-k row names the same token twice"
    if not logprobs_valid(logprobs):
        return f"top_k_range: a top-k logprob is NaN, infinite or outside [{MIN_LOGPROB:g}, 0]"
    if logprobs.size and np.exp(np.asarray(logprobs, dtype=np.float64)).sum(axis=1).max() > 1 + 1e-2:
        return "top_k_sum: a top-k row's probabilities sum to more than 1"
    return ""


def surely_valid(rollouts: list[Rollout], limits: RolloutLimits) -> list[bool]:
    """For each rollout, True when it passes every check of `validate_rollout`; False when one may
    fail (or its kind is not covered: a loss mask, teacher logprobs, a reference reward), so that
    `validate_rollout` is called and names the reason. The numeric checks run over the whole list
    at once: a few numpy calls a read instead of a dozen a rollout (the trainer's main thread holds
    the GIL the training thread needs between its ops)."""
    plain = [
        not (
            r.loss_mask is not None
            or r.teacher_logprobs is not None
            or r.teacher_top_ids is not None
            or r.teacher_top_logprobs is not None
            or r.reference_reward is not None
        )
        and _scalars_valid(r, limits)
        for r in rollouts
    ]
    chosen = [r for r, ok in zip(rollouts, plain, strict=True) if ok]
    if not chosen or _arrays_valid(chosen, limits):
        return plain
    return [False] * len(rollouts)  # one failed: each is checked on its own


def _scalars_valid(r: Rollout, limits: RolloutLimits) -> bool:
    completion = len(r.completion_token_ids)
    prompt = len(r.prompt_token_ids)
    trace = r.routing_trace
    return bool(
        r.rollout_id
        and r.group_id
        and SOURCE_NAME.fullmatch(r.source)
        and r.group_size >= 1
        and r.sample_index < r.group_size
        and prompt > 0
        and completion > 0
        and prompt + completion <= limits.max_total_tokens
        and len(r.inference_logprobs) == completion
        and len(r.policy_versions) == completion
        and reward_valid(r.reward)
        and all(math.isfinite(v) for v in r.env_metrics.values())
        and (
            trace is None
            or (
                trace.ndim == 3
                and trace.shape[0] == prompt + completion - 1
                and limits.num_layers in (None, trace.shape[1])
                and limits.top_k in (None, trace.shape[2])
            )
        )
    )


def _arrays_valid(rollouts: list[Rollout], limits: RolloutLimits) -> bool:
    """Every array check of `validate_rollout`, for rollouts whose scalars passed, at once."""
    tokens = np.concatenate([a for r in rollouts for a in (r.prompt_token_ids, r.completion_token_ids)])
    if tokens.min() < 0 or (limits.vocab_size is not None and tokens.max() >= limits.vocab_size):
        return False
    logprobs = np.concatenate([r.inference_logprobs for r in rollouts])
    if not logprobs_valid(logprobs):
        return False
    versions = np.concatenate([r.policy_versions for r in rollouts])
    falls = versions[1:] < versions[:-1]
    starts = np.cumsum([len(r.policy_versions) for r in rollouts])[:-1]  # where one rollout's versions begin
    falls[starts - 1] = False  # a drop from one rollout to the next is no drop
    if falls.any() or (limits.max_version is not None and int(versions.max()) > limits.max_version):
        return False
    traced = [r for r in rollouts if r.routing_trace is not None]
    if not traced:
        return True
    if len(traced) < len(rollouts) or len({r.routing_trace.shape[2] for r in traced}) > 1:
        return False  # a mixed read: checked one by one
    if limits.num_experts is None and any(r.num_experts != traced[0].num_experts for r in traced):
        return False
    k = traced[0].routing_trace.shape[2]
    sets = np.concatenate(
        [r.routing_trace.reshape(r.routing_trace.shape[0] * r.routing_trace.shape[1], k) for r in traced]
    )
    num_experts = limits.num_experts or traced[0].num_experts
    if num_experts and sets.size and int(sets.max()) >= num_experts:
        return False
    slots = np.ascontiguousarray(sets.T)
    return not any((slots[d:] == slots[:-d]).any() for d in range(1, k))  # k < 2: no pair to compare


def _validate_trace(rollout: Rollout, limits: RolloutLimits) -> None:
    trace = rollout.routing_trace
    assert trace is not None
    if trace.ndim != 3 or trace.shape[0] != rollout.num_positions:
        raise RolloutError(
            "trace_shape", f"routing trace shape {trace.shape}, expected ({rollout.num_positions}, layers, top_k)"
        )
    for name, size, limit in (("layers", trace.shape[1], limits.num_layers), ("top_k", trace.shape[2], limits.top_k)):
        if limit is not None and size != limit:
            raise RolloutError("trace_shape", f"routing trace has {size} {name}, the model has {limit}")
    num_experts = limits.num_experts or rollout.num_experts
    if num_experts and trace.size and int(trace.max()) >= num_experts:
        raise RolloutError("expert_range", f"expert id {int(trace.max())} >= num_experts {num_experts}")
    k = trace.shape[2]
    if k > 1:
        # slot-major copy; comparing slot i with slot i + d for every distance d covers every pair
        # (6.6× faster than sorting each top-k set on a 30B-A3B-sized trace)
        slots = np.ascontiguousarray(trace.reshape(-1, k).T)
        if any((slots[d:] == slots[:-d]).any() for d in range(1, k)):
            raise RolloutError("expert_duplicate", "a top-k set names the same expert twice")
