"""The trainer's GroupBuffer: verdicts on stream entries without Redis or a model."""

import dataclasses

import numpy as np

from services.trainer.groups import GroupBuffer
from shared.rollouts.record import Rollout, RolloutLimits, encode_rollout

G = 4
RUN = "run-a"
STAMP = "replica-0|0"


def rollout(task: str, index: int, **changes) -> Rollout:
    base = Rollout(
        rollout_id=f"{task}:{index}",
        group_id=task,
        task_id=task,
        run_id=RUN,
        sample_index=index,
        group_size=G,
        prompt_token_ids=np.array([1, 5, 6], dtype=np.int32),
        completion_token_ids=np.array([7, 2], dtype=np.int32),
        inference_logprobs=np.array([-0.5, -0.1], dtype=np.float32),
        policy_versions=np.array([3, 3], dtype=np.uint64),
        reward=float(index % 2),
    )
    return dataclasses.replace(base, **changes)


def entry(r: Rollout, lease: str = STAMP, published: int = G, task: str | None = None) -> dict[bytes, bytes]:
    return {
        b"task": (task or r.task_id).encode(),
        b"lease": lease.encode(),
        b"n": str(published).encode(),
        b"r": encode_rollout(r),
    }


def buffer() -> GroupBuffer:
    return GroupBuffer(G, RUN, RolloutLimits(vocab_size=16, max_total_tokens=64))


def stamps(*tasks: str) -> dict[str, str]:
    return {t: STAMP for t in tasks}


def accept(buf: GroupBuffer, eid: str, fields, version: int = 5, trained=frozenset(), known=None):
    return buf.accept(eid.encode(), fields, known if known is not None else stamps("t1", "t2"), version, set(trained))


def test_a_whole_group_is_held_then_taken_in_sample_order():
    buf = buffer()
    for index in (2, 0, 3, 1):
        assert accept(buf, f"e{index}", entry(rollout("t1", index))).kind == "held"
    assert buf.complete() == ["t1"] and buf.held == G
    [group] = buf.take(["t1"])
    assert [m.rollout.sample_index for m in group] == [0, 1, 2, 3] and [m.entry for m in group][0] == b"e0"
    assert buf.held == 0 and buf.complete() == []


def test_redelivery_duplicates_and_trained_ids():
    buf = buffer()
    first = entry(rollout("t1", 0))
    assert accept(buf, "e0", first).kind == "held"
    assert accept(buf, "e0", first).kind == "again"  # the same entry claimed again
    assert accept(buf, "e9", first).kind == "duplicate"  # the same rollout in another entry
    assert accept(buf, "e1", entry(rollout("t2", 1)), trained={"t2:1"}).kind == "trained"
    # dropped as stale already (the drop was lost with Redis, the task ran again): never trained
    assert buf.accept(b"e2", entry(rollout("t2", 2)), stamps("t2"), 5, set(), {"t2:2"}).kind == "duplicate"
    assert buf.held == 1


def test_foreign_and_stray_entries_are_dead_without_harming_the_real_group():
    buf = buffer()
    verdicts = {
        "missing": accept(buf, "x0", {b"task": b"t1"}),
        "garbage": accept(buf, "x1", {b"r": b"\x00\xff garbage", b"task": b"t1"}),
        "other_run": accept(buf, "x2", entry(rollout("t1", 0, run_id="run-b"))),
        "eval": accept(buf, "x3", entry(rollout("t1", 0, is_eval=True))),
        "unleased": accept(buf, "x4", {**entry(rollout("t1", 0)), b"lease": b""}),
        "stale_lease": accept(buf, "x5", entry(rollout("t1", 0), lease="replica-9|2")),
        "before_its_task": accept(buf, "x6", entry(rollout("t3", 0))),  # t3 not completed by any lease yet
        "task_mismatch": accept(buf, "x7", entry(rollout("t2", 0), task="t1")),
    }
    assert {k: v.code for k, v in verdicts.items()} == {
        "missing": "missing_field",
        "garbage": "decode",
        "other_run": "other_run",
        "eval": "eval_rollout",
        "unleased": "no_lease",
        "stale_lease": "no_lease",
        "before_its_task": "no_lease",
        "task_mismatch": "task_mismatch",
    }
    assert all(v.kind == "dead" and not v.group for v in verdicts.values()) and not buf.dead_groups
    for index in range(G):  # the real group is untouched and completes
        assert accept(buf, f"e{index}", entry(rollout("t1", index))).kind == "held"
    assert buf.complete() == ["t1"]


def test_a_bad_member_poisons_its_group_and_releases_what_was_held():
    buf = buffer()
    assert accept(buf, "e0", entry(rollout("t1", 0))).kind == "held"
    assert accept(buf, "e1", entry(rollout("t1", 1))).kind == "held"
    bad = rollout("t1", 2, inference_logprobs=np.array([np.nan, -0.1], dtype=np.float32))
    verdict = accept(buf, "e2", entry(bad))
    assert (verdict.kind, verdict.code, verdict.group) == ("dead", "nonfinite_logprobs", "t1")
    assert sorted(m.entry for m in verdict.released) == [b"e0", b"e1"]
    late = accept(buf, "e3", entry(rollout("t1", 3)))
    assert (late.kind, late.code) == ("dead", "group_poisoned")
    assert buf.held == 0 and buf.complete() == [] and buf.dead_groups == {"t1"}


def test_mis_sized_over_full_and_misnamed_groups_are_refused():
    cases = {
        "group_size": entry(rollout("t1", 0, group_size=8)),
        "publication_size": entry(rollout("t1", 0), published=G + 1),  # one of 5: an over-full publication
        "rollout_id": entry(rollout("t1", 0, rollout_id="t1:zero")),
        "group": entry(rollout("t1", 0, sample_index=G)),  # sample index outside the group
    }
    for code, fields in cases.items():
        buf = buffer()
        verdict = accept(buf, "e0", fields)
        assert (verdict.kind, verdict.code, verdict.group) == ("dead", code, "t1"), code
    buf = buffer()
    assert accept(buf, "e0", entry(rollout("t1", 0))).kind == "held"
    other_prompt = rollout("t1", 1, prompt_token_ids=np.array([1, 9, 9], dtype=np.int32))
    assert accept(buf, "e1", entry(other_prompt)).code == "group_mismatch"


def test_future_versions_and_rollouts_longer_than_the_context():
    buf = buffer()
    assert accept(buf, "e0", entry(rollout("t1", 0)), version=2).code == "future_version"  # tokens of v3 at v2
    long = rollout(
        "t2",
        0,
        completion_token_ids=np.full(70, 3, dtype=np.int32),
        inference_logprobs=np.full(70, -0.2, dtype=np.float32),
        policy_versions=np.full(70, 3, np.uint64),
    )
    assert accept(buf, "e1", entry(long)).code == "oversize"  # 73 tokens, the model has 64 positions


def test_stale_groups_are_dropped_whole():
    buf = buffer()
    for index in range(2):
        accept(buf, f"a{index}", entry(rollout("t1", index, policy_versions=np.array([1, 2], dtype=np.uint64))))
        accept(buf, f"b{index}", entry(rollout("t2", index)))
    [dropped] = buf.drop_stale(oldest_allowed=2)
    assert sorted(m.entry for m in dropped) == [b"a0", b"a1"] and list(buf.groups) == ["t2"]
