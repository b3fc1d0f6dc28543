"""Sampling parameters are checked to finite, sane ranges wherever they enter: a
temperature of 1e-40 overflowed the torch engine's sampling and failed every sequence in flight."""

import math

import pytest

from shared.rollouts.sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, Sampling


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"temperature": 1e-40}, "temperature"),
        ({"temperature": MIN_TEMPERATURE / 2}, "temperature"),
        ({"temperature": MAX_TEMPERATURE * 2}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2**40}, "max_new_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop_token_ids": (-3,)}, "stop token"),
    ],
)
def test_out_of_range_sampling_is_refused_with_its_name(fields, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**fields)


def test_the_edges_of_each_range_are_accepted():
    assert Sampling(temperature=0).temperature == 0
    assert Sampling(temperature=MIN_TEMPERATURE, top_p=1e-6, top_k=-1).temperature == MIN_TEMPERATURE
    assert Sampling(temperature=MAX_TEMPERATURE, max_new_tokens=1, seed=2**62).seed == 2**62
