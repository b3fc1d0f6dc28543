"""`steadyrl bench all --only X --update`: the other benchmarks keep their dated figures."""

import pytest

from bench.suite import machine, main, markdown


def test_an_update_keeps_earlier_figures_dated_and_refuses_another_machine():
    earlier = {"machine": machine(), "date": "2026-01-02",
               "benchmarks": {"weightsync": {"ratios": {"two_over_one": {"torch": {"collective": 0.97}}},
                                             "targets": {"two_over_one": 0.8}},
                              "inference": {"service_to_bare_ratio": 0.8, "date": "2026-01-01"}}}
    merged = main(["no-such-benchmark"], earlier)  # runs nothing: only the merge
    assert list(merged["benchmarks"]) == ["weightsync", "inference"]
    assert merged["benchmarks"]["weightsync"]["date"] == "2026-01-02"
    assert merged["benchmarks"]["inference"]["date"] == "2026-01-01"
    text = markdown(merged)
    assert "weightsync 2026-01-02, inference 2026-01-01" in text
    assert "| weightsync | rate with 2 replicas / with 1 (seconds 1 / seconds 2), torch | collective 0.97 | ≥ 0.8 |" in text
    with pytest.raises(ValueError, match="another machine"):
        main([], {**earlier, "machine": {"cpu": "elsewhere"}})
