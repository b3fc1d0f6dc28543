"""DAPO's soft overlong punishment (`shared.tasks.shaping.overlong_penalty`) and its settings."""

import pytest

from services.orchestrator.config import SamplingSettings
from shared.tasks.shaping import overlong_penalty


@pytest.mark.parametrize(
    ("length", "expected"),
    [(1, 0.0), (4, 0.0), (5, -0.25), (6, -0.5), (7, -0.75), (8, -1.0), (9, -1.0)],
)
def test_the_penalty_grows_linearly_over_the_last_buffer_tokens(length, expected):
    # budget 8, buffer 4: free up to 4 tokens, then a quarter of the penalty (here 1) per token
    assert overlong_penalty(length, 8, 4, 1.0) == pytest.approx(expected)


def test_off_scaled_and_refused():
    assert overlong_penalty(8, 8, 0, 1.0) == 0.0
    assert overlong_penalty(7, 8, 4, 0.5) == pytest.approx(-0.375)
    with pytest.raises(ValueError, match="buffer < budget"):
        overlong_penalty(8, 8, 8, 1.0)
    with pytest.raises(ValueError, match="penalty"):
        overlong_penalty(8, 8, 4, float("nan"))


def test_a_buffer_as_long_as_the_budget_is_refused_before_the_run():
    assert SamplingSettings(max_new_tokens=6, overlong_buffer=2).overlong_buffer == 2
    with pytest.raises(ValueError, match="overlong_buffer .4. must be less than max_new_tokens .4."):
        SamplingSettings(max_new_tokens=4, overlong_buffer=4)
