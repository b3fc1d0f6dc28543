"""Rollout codec: round trip, validation reasons, and a fuzz of the decoder."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.rollouts.record import (
    Rollout,
    RolloutError,
    RolloutLimits,
    RolloutTimings,
    decode_rollout,
    encode_rollout,
    surely_valid,
    validate_rollout,
)
from shared.rollouts.samples import encode_samples, rollouts_from_samples

LIMITS = RolloutLimits(vocab_size=64, num_layers=2, top_k=2, num_experts=8, max_version=10)


def make_rollout(prompt_len=3, completion_len=4, trace=True, **overrides) -> Rollout:
    rng = np.random.default_rng(0)
    positions = prompt_len + completion_len - 1
    routing = np.stack([rng.permutation(8)[:2] for _ in range(positions * 2)]).reshape(positions, 2, 2)
    fields = dict(
        rollout_id="r-1",
        group_id="g-1",
        run_id="run",
        task_id="t-1",
        sample_index=1,
        group_size=4,
        prompt_token_ids=np.arange(prompt_len, dtype=np.int32),
        completion_token_ids=np.arange(completion_len, dtype=np.int32) + 10,
        inference_logprobs=-np.linspace(0.1, 2.0, completion_len).astype(np.float32),
        policy_versions=np.array([3] * (completion_len - 1) + [4], dtype=np.uint64),
        reward=1.0,
        routing_trace=routing.astype(np.uint8) if trace else None,
        num_experts=8 if trace else 0,
        finish_reason="stop",
        replica_id="inf-0",
        engine="torch",
        timings=RolloutTimings(1, 2, 3, 0.5),
    )
    fields.update(overrides)
    return Rollout(**fields)


def assert_same(a: Rollout, b: Rollout) -> None:
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, np.ndarray):
            assert other.dtype == value.dtype or name == "routing_trace", name
            np.testing.assert_array_equal(other, value, err_msg=name)
        else:
            assert other == value, name


def test_round_trip_and_validates():
    rollout = make_rollout()
    back = decode_rollout(encode_rollout(rollout), LIMITS)
    assert_same(rollout, back)
    assert validate_rollout(back, LIMITS) is back


def test_wide_expert_ids_use_uint16():
    rollout = make_rollout(num_experts=300)
    rollout.routing_trace = rollout.routing_trace.astype(np.uint16) + 256
    back = decode_rollout(encode_rollout(rollout))
    assert back.routing_trace.dtype == np.uint16
    np.testing.assert_array_equal(back.routing_trace, rollout.routing_trace)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 30),
    st.integers(1, 30),
    st.integers(0, 5),
    st.integers(1, 4),
    st.integers(2, 600),
    st.floats(-1e6, 1e6),
    st.text(max_size=20),
    st.integers(0, 2**31 - 1),
)
def test_round_trip_property(prompt_len, completion_len, layers, top_k, experts, reward, rid, seed):
    rng = np.random.default_rng(seed)
    positions = prompt_len + completion_len - 1
    trace = rng.integers(0, experts, size=(positions, layers, top_k)) if layers else None
    dtype = np.uint16 if experts > 256 else np.uint8
    rollout = Rollout(
        rollout_id=rid,
        group_id="g",
        prompt_token_ids=rng.integers(0, 2**31 - 1, prompt_len).astype(np.int32),
        completion_token_ids=rng.integers(0, 2**31 - 1, completion_len).astype(np.int32),
        inference_logprobs=-rng.random(completion_len).astype(np.float32) * 20,
        policy_versions=np.sort(rng.integers(0, 2**40, completion_len)).astype(np.uint64),
        reward=reward,
        routing_trace=None if trace is None else trace.astype(dtype),
        num_experts=experts if layers else 0,
    )
    assert_same(rollout, decode_rollout(encode_rollout(rollout)))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(0, 3),
    st.sampled_from([8, 300]),
    st.booleans(),
    st.text(max_size=8),
    st.integers(0, 2**31 - 1),
)
def test_encode_samples_equals_encoding_each_rollout(group, layers, experts, is_eval, group_id, seed):
    from shared.engines import Sample
    from shared.rpc.steadyrl.v1 import common_pb2

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 2**31 - 1, int(rng.integers(1, 20))).tolist()
    task = common_pb2.PromptTask(
        task_id=f"t{seed}", run_id="run", group_id=group_id, prompt_token_ids=prompt, is_eval=is_eval
    )
    samples = []
    for _ in range(group):
        n = int(rng.integers(1, 12))
        trace = rng.integers(0, experts, size=(len(prompt) + n - 1, layers, 2)) if layers else None
        samples.append(
            Sample(
                token_ids=rng.integers(0, 2**31 - 1, n).tolist(),
                logprobs=(-rng.random(n) * 9).tolist(),
                versions=sorted(rng.integers(0, 2**40, n).tolist()),
                finish_reason="length",
                routing_trace=None if trace is None else trace.astype(np.uint16 if experts > 256 else np.uint8),
                num_experts=experts if layers else 0,
            )
        )
    rewards = rng.random(group).tolist()
    timings = RolloutTimings(5, 6, 7, 0.25)
    expected = rollouts_from_samples(task, samples, rewards, "inf-0", "torch", timings)
    encoded = encode_samples(task, samples, rewards, "inf-0", "torch", timings)
    assert len(encoded) == group
    for want, data in zip(expected, encoded, strict=True):
        assert_same(want, decode_rollout(data))
        assert len(data) == len(encode_rollout(want))


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"rollout_id": ""}, "missing_id"),
        ({"group_id": ""}, "missing_id"),
        ({"sample_index": 4}, "group"),
        (
            {
                "completion_token_ids": np.array([], np.int32),
                "inference_logprobs": np.array([], np.float32),
                "policy_versions": np.array([], np.uint64),
                "routing_trace": None,
            },
            "empty",
        ),
        ({"inference_logprobs": np.array([-1, -1, -1], np.float32)}, "length"),
        ({"policy_versions": np.array([1, 2], np.uint64)}, "length"),
        ({"inference_logprobs": np.array([-1, np.nan, -1, -1], np.float32)}, "nonfinite_logprobs"),
        ({"inference_logprobs": np.array([-1, -np.inf, -1, -1], np.float32)}, "nonfinite_logprobs"),
        ({"inference_logprobs": np.array([-1, 0.5, -1, -1], np.float32)}, "logprob_range"),
        ({"reward": float("nan")}, "nonfinite_reward"),
        ({"policy_versions": np.array([4, 3, 3, 3], np.uint64)}, "version_order"),
        ({"policy_versions": np.array([3, 3, 11, 11], np.uint64)}, "future_version"),
        ({"completion_token_ids": np.array([10, 11, 12, 64], np.int32)}, "token_range"),
        ({"completion_token_ids": np.array([10, 11, 12, -1], np.int32)}, "token_range"),
        ({"routing_trace": np.zeros((5, 2, 2), np.uint8)}, "trace_shape"),
        ({"routing_trace": np.tile(np.array([0, 1], np.uint8), (6, 3, 1))}, "trace_shape"),
        ({"routing_trace": np.tile(np.array([0, 8], np.uint8), (6, 2, 1))}, "expert_range"),
        ({"routing_trace": np.tile(np.array([3, 3], np.uint8), (6, 2, 1))}, "expert_duplicate"),
    ],
)
def test_validator_reasons(overrides, reason):
    rollout = make_rollout(**overrides)
    with pytest.raises(RolloutError) as err:
        validate_rollout(decode_rollout(encode_rollout(rollout)), LIMITS)
    assert err.value.reason == reason
    assert str(err.value).startswith(reason + ": ")
    # the checks made over a whole read never call it surely valid, whatever its neighbours
    good = [decode_rollout(encode_rollout(make_rollout(rollout_id=f"g{i}"))) for i in range(3)]
    assert surely_valid([*good[:1], decode_rollout(encode_rollout(rollout)), *good[1:]], LIMITS)[1] is False


def test_a_read_of_valid_rollouts_is_surely_valid_at_once():
    """Versions that fall from one rollout to the next are no fall; a loss mask is left to the
    one-by-one check (the read's other rollouts stay sure)."""
    reads = [
        make_rollout(rollout_id="a", policy_versions=np.array([7, 7, 8, 9], np.uint64)),
        make_rollout(rollout_id="b", policy_versions=np.array([2, 3, 3, 3], np.uint64)),
        make_rollout(rollout_id="c", trace=True),
        make_rollout(rollout_id="d", loss_mask=np.array([1, 0, 1, 1], bool)),
    ]
    rollouts = [decode_rollout(encode_rollout(r)) for r in reads]
    for r in rollouts:
        validate_rollout(r, LIMITS)
    assert surely_valid(rollouts, LIMITS) == [True, True, True, False]
    assert surely_valid([], LIMITS) == []
    # a trace of top-0 (no expert named; valid where the model's top_k is not known) breaks nothing
    empty = decode_rollout(encode_rollout(make_rollout(rollout_id="e", routing_trace=np.zeros((6, 2, 0), np.uint8))))
    unknown_k = RolloutLimits(vocab_size=64, num_layers=2, num_experts=8, max_version=10)
    validate_rollout(empty, unknown_k)
    assert surely_valid([empty, empty], unknown_k) == [True, True]


TOP_IDS = np.array([[1, 2], [3, 4], [5, 6], [7, 8]], np.int32)
TOP_LOGPROBS = np.log(np.array([[0.5, 0.25], [0.9, 0.05], [0.4, 0.4], [0.3, 0.2]], np.float32))


def test_the_teacher_s_top_k_round_trips_and_is_validated():
    rollout = make_rollout(teacher_top_ids=TOP_IDS, teacher_top_logprobs=TOP_LOGPROBS)
    back = decode_rollout(encode_rollout(rollout))
    assert_same(rollout, back)
    assert back.teacher_top_ids.shape == (4, 2)
    validate_rollout(back, LIMITS)
    bad = {
        "ids without logprobs": {"teacher_top_ids": TOP_IDS},
        "a row short": {"teacher_top_ids": TOP_IDS[:3], "teacher_top_logprobs": TOP_LOGPROBS[:3]},
        "an id past the vocabulary": {"teacher_top_ids": TOP_IDS + 56, "teacher_top_logprobs": TOP_LOGPROBS},
        "an id twice in a row": {"teacher_top_ids": TOP_IDS * 0 + 3, "teacher_top_logprobs": TOP_LOGPROBS},
        "a logprob above 0": {"teacher_top_ids": TOP_IDS, "teacher_top_logprobs": -TOP_LOGPROBS},
        "a NaN": {"teacher_top_ids": TOP_IDS, "teacher_top_logprobs": TOP_LOGPROBS * np.nan},
        "a row summing past 1": {"teacher_top_ids": TOP_IDS, "teacher_top_logprobs": TOP_LOGPROBS * 0 - 0.1},
    }
    for what, overrides in bad.items():
        with pytest.raises(RolloutError) as err:
            validate_rollout(make_rollout(**overrides), LIMITS)
        assert err.value.reason == "teacher_top", what
    from shared.rpc.steadyrl.v1 import rollout_pb2

    msg = rollout_pb2.Rollout()
    msg.ParseFromString(encode_rollout(rollout))
    msg.teacher_top.k = 3  # 8 ids are not rows of 3
    with pytest.raises(RolloutError, match="teacher_top: 8 ids and 8 logprobs do not fill rows of k = 3"):
        decode_rollout(msg.SerializeToString())


def test_oversize_is_rejected_before_parsing_and_by_token_count():
    data = encode_rollout(make_rollout())
    with pytest.raises(RolloutError, match="oversize"):
        decode_rollout(data, RolloutLimits(max_encoded_bytes=len(data) - 1))
    with pytest.raises(RolloutError, match="oversize"):
        validate_rollout(decode_rollout(data), RolloutLimits(max_total_tokens=6))


def test_trace_bytes_that_do_not_fit_the_shape():
    from shared.rpc.steadyrl.v1 import rollout_pb2

    msg = rollout_pb2.Rollout()
    msg.ParseFromString(encode_rollout(make_rollout()))
    msg.routing_trace.expert_ids = msg.routing_trace.expert_ids[:-1]
    with pytest.raises(RolloutError, match="trace_shape"):
        decode_rollout(msg.SerializeToString())
    msg.routing_trace.dtype = 0
    with pytest.raises(RolloutError, match="trace_dtype"):
        decode_rollout(msg.SerializeToString())


def correlated_trace(
    positions: int, layers: int = 48, top_k: int = 8, experts: int = 128, keep: float = 0.5, seed: int = 0
) -> np.ndarray:
    """A 30B-A3B-shaped trace: distinct top-k sets; each (layer, slot) keeps the previous token's
    expert with probability `keep` (0: uniformly random sets)."""
    rng = np.random.default_rng(seed)
    trace = np.argsort(rng.random((positions, layers, experts)), axis=-1)[..., :top_k]
    for t in range(1, positions):
        same = rng.random(layers) < keep
        trace[t][same] = trace[t - 1][same]
    return trace  # int64, as an engine may hand it over


@pytest.mark.parametrize(("keep", "most_bytes_per_token"), [(0.0, 337), (0.5, 200)])
def test_traces_travel_one_byte_per_id_and_compressed(keep, most_bytes_per_token):
    """An int64 trace of 128 experts goes as uint8 (384 B per token for 48 layers × top-8), then
    zstd: uniformly random sets reach the 7-bit bound (336 B), repeated routing less."""
    from shared.rpc.steadyrl.v1 import rollout_pb2

    trace = correlated_trace(1000, keep=keep)
    rollout = make_rollout(1, 1000, trace=False)
    rollout.routing_trace = trace
    rollout.num_experts = 128
    msg = rollout_pb2.Rollout()
    msg.ParseFromString(encode_rollout(rollout))
    assert msg.routing_trace.dtype == rollout_pb2.RoutingTrace.UINT8 and msg.routing_trace.zstd
    per_token = len(msg.routing_trace.expert_ids) / 1000
    assert per_token <= most_bytes_per_token, per_token
    back = decode_rollout(msg.SerializeToString())
    assert back.routing_trace.dtype == np.uint8
    np.testing.assert_array_equal(back.routing_trace, trace)


def test_a_compressed_trace_that_lies_about_its_size_is_refused_unexpanded():
    import zstandard

    from shared.rpc.steadyrl.v1 import rollout_pb2

    rollout = make_rollout(1, 200, trace=False)
    rollout.routing_trace = correlated_trace(200, 2, 2, 8, keep=0.9)
    rollout.num_experts = 8
    msg = rollout_pb2.Rollout()
    msg.ParseFromString(encode_rollout(rollout))
    assert msg.routing_trace.zstd
    msg.routing_trace.expert_ids = zstandard.ZstdCompressor().compress(bytes(10_000_000))  # a bomb: 10 MB of zeros
    with pytest.raises(RolloutError, match=r"trace_shape: routing trace holds 801 bytes"):  # read stops 1 byte past
        decode_rollout(msg.SerializeToString())
    msg.routing_trace.expert_ids = b"not a zstd frame at all"
    with pytest.raises(RolloutError, match="trace_decompress"):
        decode_rollout(msg.SerializeToString())
    msg.routing_trace.num_positions = 1 << 30  # a shape past the bound is refused before inflating
    with pytest.raises(RolloutError, match="trace_shape"):
        decode_rollout(msg.SerializeToString())


def test_fuzz_random_and_corrupted_bytes_raise_only_rollout_error():
    """10,000 inputs: random bytes, and valid encodings bit-flipped, truncated, spliced (one of
    them with a zstd-compressed trace)."""
    rng = np.random.default_rng(1234)
    seeds = [
        encode_rollout(make_rollout(p, c, trace=t))
        for p, c, t in [(3, 4, True), (5, 9, True), (2, 2, False), (30, 40, True)]
    ]
    assert b"\x28\xb5\x2f\xfd" in seeds[-1]  # the zstd frame's magic number
    outcomes = {"accepted": 0, "rejected": 0}
    for i in range(10_000):
        kind = i % 4
        base = bytearray(seeds[i % len(seeds)])
        if kind == 0:
            data = rng.bytes(int(rng.integers(0, 200)))
        elif kind == 1:
            for _ in range(int(rng.integers(1, 8))):
                pos = int(rng.integers(0, len(base)))
                base[pos] ^= 1 << int(rng.integers(0, 8))
            data = bytes(base)
        elif kind == 2:
            data = bytes(base[: int(rng.integers(0, len(base)))])
        else:
            other = seeds[int(rng.integers(0, len(seeds)))]
            cut = int(rng.integers(0, len(base)))
            data = bytes(base[:cut]) + other[int(rng.integers(0, len(other))) :]
        try:
            validate_rollout(decode_rollout(data), LIMITS)
            outcomes["accepted"] += 1
        except RolloutError:
            outcomes["rejected"] += 1
    assert sum(outcomes.values()) == 10_000
    assert outcomes["rejected"] > 9_000, outcomes


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_completions_equals_decoding_each(tiny_model_dir, clean_up):
    from shared.models import decode_completions, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.clean_up_tokenization_spaces = clean_up  # True: the wrapper's own path
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, tokenizer.vocab_size, int(rng.integers(0, 20))).tolist() for _ in range(200)]
    texts = decode_completions(tokenizer, ids)
    assert texts == [tokenizer.decode(x, skip_special_tokens=True) for x in ids]
    assert sum(len(t) for t in texts) > 1000
