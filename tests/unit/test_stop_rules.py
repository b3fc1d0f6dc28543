"""The stop rules on hand-made histories: each fires exactly when its
threshold is crossed, and never on a run that makes progress."""

from services.orchestrator.stop_rules import StopRules, StopWatch

RULES = StopRules(stalled_seconds=60, dead_share=0.9, window_tasks=10, reward_failure_share=0.5, window_steps=3)


def test_dead_share_judges_the_last_window_of_ended_tasks():
    watch = StopWatch(RULES)
    assert watch.observe(0, trained=0, dead=0, step=0, metrics={}) is None
    assert watch.observe(1, trained=8, dead=1, step=1, metrics={}) is None  # 9 ended: not a window yet
    assert watch.observe(2, trained=8, dead=2, step=1, metrics={}) is None  # 10 ended, 2 dead: 20 %
    assert watch.observe(3, trained=8, dead=9, step=1, metrics={}) is None  # 17 ended, 9 dead: 53 %
    verdict = watch.observe(4, trained=8, dead=12, step=1, metrics={})  # since the sample at 10 ended: 10 dead
    assert verdict.rule == "dead_share" and verdict.reason.startswith("10 of the last 10 train tasks")


def test_a_stall_fails_only_while_tasks_keep_dying():
    watch = StopWatch(RULES.model_copy(update={"dead_share": 1.0, "window_tasks": 10**6}))
    assert watch.observe(0, trained=8, dead=0, step=1, metrics={}) is None
    assert watch.observe(100, trained=8, dead=0, step=1, metrics={}) is None  # idle, nothing dying: waiting
    verdict = watch.observe(130, trained=8, dead=3, step=1, metrics={})
    assert verdict.rule == "stalled" and "130 s" in verdict.reason and "3 train tasks" in verdict.reason
    assert watch.observe(131, trained=16, dead=3, step=2, metrics={}) is None  # a step: the clock starts again
    assert (
        StopWatch(RULES.model_copy(update={"stalled_seconds": 0, "dead_share": 1.0, "window_tasks": 10**6})).observe(
            10**6, trained=0, dead=50, step=0, metrics={}
        )
        is None
    )  # 0: never


def test_failing_rewards_over_the_last_steps():
    watch = StopWatch(RULES)
    shares = {1: 0.9, 2: 0.0, 3: 0.6, 4: 0.9}  # windows of 3: mean 0.5 at step 3 (fires), 0.5 at step 4
    verdicts = [
        watch.observe(s, trained=8 * s, dead=0, step=s, metrics={"step": s, "reward_failures": v})
        for s, v in shares.items()
    ]
    assert verdicts[:2] == [None, None] and verdicts[2].rule == "reward_failures"
    healthy = StopWatch(RULES)
    assert all(
        healthy.observe(s, trained=8 * s, dead=0, step=s, metrics={"step": s, "reward_failures": 0.1}) is None
        for s in range(1, 50)
    )
