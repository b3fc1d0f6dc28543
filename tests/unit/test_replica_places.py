"""A replica's places for tasks (`services.inference.worker.free_places`): `tasks.max_inflight`
counts tasks of the run's G; an eval prompt (one sample) takes 1/G of a place, so an eval round
fills the engine's batch as a training step does."""

from services.inference.worker import free_places


def test_training_tasks_take_a_place_each():
    assert free_places(32, [], 8) == 32
    assert free_places(32, [8] * 31, 8) == 1 and free_places(32, [8] * 32, 8) == 0


def test_eval_prompts_take_their_share_of_a_place():
    assert free_places(32, [1] * 16, 8) == 30  # 16 eval prompts: two places
    assert free_places(32, [1] * 256, 8) == 0  # 256 of them: the whole batch, as a step's 32 groups of 8
    assert free_places(32, [1] * 17, 8) == 29  # a started place is taken
    assert free_places(32, [8] * 16 + [1] * 8, 8) == 15


def test_a_group_wider_than_the_run_s_takes_more_than_one_place():
    assert free_places(4, [16], 8) == 2 and free_places(4, [16, 16], 8) == 0


def test_a_task_s_claimed_size_is_bounded_before_it_is_checked():
    from services.inference.leased_work import MAX_GROUP_SIZE
    from services.inference.worker import place_size

    assert [place_size(g) for g in (8, 1, 0, -5, 10**12)] == [8, 1, 1, 1, MAX_GROUP_SIZE]
    # a task claiming a huge G (dead-lettered once checked) takes every place meanwhile, and the run's G
    # still weighs a training task: nothing a task claims changes what the others count
    assert free_places(32, [place_size(10**12)], 8) < 0 and free_places(32, [8] * 31, 8) == 1
