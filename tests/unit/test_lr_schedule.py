"""The learning rate's schedule over a run: warm-up, then constant, cosine or linear to a floor."""

import math

import pytest

from services.trainer.config import TrainerSettings
from shared.core.lr_schedule import lr_factor


def test_each_schedule_by_hand():
    total = 10
    assert [lr_factor(s, total) for s in range(total)] == [1.0] * total
    assert [lr_factor(s, total, "constant", warmup=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = [lr_factor(s, total, "linear", warmup=1, floor=0.1) for s in range(total)]
    assert linear == pytest.approx([1.0] + [0.1 + 0.9 * (1 - k / 8) for k in range(9)])
    cosine = [lr_factor(s, total, "cosine", floor=0.0) for s in range(total)]
    assert cosine == pytest.approx([0.5 * (1 + math.cos(math.pi * s / 9)) for s in range(total)])
    assert cosine[0] == 1.0 and cosine[-1] == pytest.approx(0.0) and cosine == sorted(cosine, reverse=True)
    assert lr_factor(25, total, "cosine", floor=0.2) == pytest.approx(0.2)  # past the end: the floor
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'step'"):
        lr_factor(0, total, "step")


def test_a_decay_without_the_run_s_length_is_refused():
    base = dict(model_path="m", redis_url="redis://x", unsigned_weights=True)
    with pytest.raises(ValueError, match=r"schedule = 'cosine' decays to the run's last step: set run.steps"):
        TrainerSettings(**base, optim={"schedule": "cosine"})
    assert TrainerSettings(**base, max_steps=100, optim={"schedule": "cosine"}).optim.min_lr_ratio == 0.0
    assert TrainerSettings(**base, optim={"warmup_steps": 10}).optim.schedule == "constant"
