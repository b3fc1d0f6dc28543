"""Admission's minimum versions (`min_versions`): the staleness budget's positions in a run that
drops nothing, and a trainer never left without tasks it can use when tasks ahead are dropped."""

import random

import pytest

from services.orchestrator.orchestrator import min_versions


def simulate(batch, staleness, lookahead, steps, drops, seed=0):
    """A run of `steps` trainer steps: admission fills the budget, then up to `drops` tasks the
    trainer could use are dropped (stale, filtered or dead) and replaced, then the trainer takes B
    it can use, oldest first. Returns each admitted task's (position among those outstanding,
    trainer version, minimum version), or raises when the trainer finds fewer than B."""
    rng = random.Random(seed)
    version, outstanding, ahead, admitted = 0, [], {}, []
    budget = (staleness + 1 + lookahead) * batch

    def admit():
        nonlocal ahead
        count = budget - len(outstanding)
        versions, ahead = min_versions(version, len(outstanding), ahead, count, batch, staleness, lookahead)
        admitted.extend((len(outstanding) + j, version, v) for j, v in enumerate(versions))
        outstanding.extend(versions)

    for _ in range(steps):
        admit()
        usable = [i for i, v in enumerate(outstanding) if v <= version]
        for i in sorted(rng.sample(usable, min(len(usable), rng.randint(0, drops))), reverse=True):
            del outstanding[i]
        admit()
        usable = [i for i, v in enumerate(outstanding) if v <= version]
        if len(usable) < batch:
            raise RuntimeError(f"stalled at version {version}: {len(usable)} usable of {outstanding}")
        for i in sorted(usable[:batch], reverse=True):
            del outstanding[i]
        version += 1
    return admitted


@pytest.mark.parametrize("staleness,lookahead", [(0, 1), (1, 1), (1, 2), (2, 3)])
def test_without_drops_a_task_asks_for_the_version_its_position_gives(staleness, lookahead):
    admitted = simulate(batch=4, staleness=staleness, lookahead=lookahead, steps=30, drops=0)
    assert len(admitted) == 4 * (30 + staleness + lookahead)
    for position, version, asked in admitted:
        assert asked == version + max(0, position // 4 - staleness)
    assert max(asked - version for _, version, asked in admitted) == lookahead


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("staleness,lookahead", [(0, 1), (1, 1), (1, 2), (2, 3)])
def test_tasks_dropped_ahead_never_leave_the_trainer_waiting(staleness, lookahead, seed):
    """Drops of up to a whole batch a step (a restarted trainer's stale rollouts; dynamic sampling
    early in a run): replacements ask for the trainer's version, and lookahead resumes after."""
    admitted = simulate(batch=4, staleness=staleness, lookahead=lookahead, steps=60, drops=4, seed=seed)
    assert max(asked - version for _, version, asked in admitted) == lookahead


def test_ahead_forgets_versions_the_trainer_reached():
    versions, ahead = min_versions(5, 8, {4: 2, 5: 1, 6: 3, 7: 1}, 2, 4, 1, 2)
    # 8 outstanding, 4 of them for versions 6 and 7: 4 ask for at most 5, below (1 + 1) × 4
    assert versions == [5, 5] and ahead == {6: 3, 7: 1}
    assert min_versions(0, 0, {}, 0, 4, 1, 2) == ([], {})
