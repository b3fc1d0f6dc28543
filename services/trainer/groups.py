"""The trainer's group buffer: stream entries in, whole groups of G rollouts out. Pure (no I/O).

Every entry gets a verdict: held (this run's training rollout, published by the lease that completed its task, not
trained or held already, valid, fitting its group) or dead with a reason code. A failed check on a rollout a real
lease published poisons its whole group (`group_poisoned`): no group waits forever, no partial group is trained.

Details: docs/internals/trainer.md"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass, field, replace

from shared.rollouts.record import (
    Rollout,
    RolloutError,
    RolloutLimits,
    decode_rollout,
    surely_valid,
    validate_rollout,
)


@dataclass
class Held:
    entry: bytes
    rollout: Rollout
    oldest: int  # the rollout's min_version, computed once (drop_stale looks at it after every read)


@dataclass
class Verdict:
    """What to do with one entry.

    kind: "held" (kept in its group), "again" (this very entry is already held: a re-claim),
    "trained" (its rollout id is in a checkpoint: acknowledge it into the ledger), "duplicate"
    (another entry carries this rollout, or it was dropped as stale or filtered already: acknowledge only),
    "dead" (dead-letter it with `code`).
    `released`: held members of a group this entry poisoned (dead-letter them too)."""

    kind: str
    code: str = ""
    message: str = ""
    rollout: Rollout | None = None
    released: list[Held] = field(default_factory=list)
    group: str = ""  # the poisoned group, when one was


Prepared = tuple[Rollout | Verdict, bool]  # an entry decoded (or its dead verdict), and surely valid


class GroupBuffer:
    def __init__(
        self,
        group_size: int,
        run_id: str,
        limits: RolloutLimits,
        dead_groups: set[str] | None = None,
        require_teacher: bool = False,
        teacher_top_k: int = 0,
    ):
        self.group_size = group_size
        self.require_teacher = require_teacher  # distillation: a rollout without the teacher's logprobs is dead
        self.teacher_top_k = teacher_top_k  # ... or without the teacher's top-k of this k
        self.run_id = run_id
        self.limits = limits
        self.groups: OrderedDict[str, dict[int, Held]] = OrderedDict()
        self.dead_groups: set[str] = set(dead_groups or ())  # poisoned: never trained

    @property
    def held(self) -> int:
        return sum(len(g) for g in self.groups.values())

    def accept(
        self,
        entry: bytes,
        fields: dict[bytes, bytes] | None,
        stamps: dict[str, str | None],
        version: int,
        trained: set[str],
        untrained: Container[str] = frozenset(),
        prepared: Prepared | None = None,
    ) -> Verdict:
        """The verdict on one stream entry. `stamps`: task id → the lease that completed it;
        `version`: the newest policy version (later ones are from the future); `trained`: rollout
        ids already in a checkpoint; `untrained`: rollout ids dropped as stale or filtered (final like a
        trained one: a copy that comes back — Redis lost the drop and the task ran again — is never
        trained, or the ledger, which records an id once, would call it dropped); `prepared`: this
        entry's item of `prepare` (else it is decoded and validated here)."""
        fields = fields or {}
        rollout, sure = prepared if prepared is not None else (self.decode(fields), False)
        if isinstance(rollout, Verdict):
            return rollout
        if rollout.run_id != self.run_id:
            return Verdict("dead", "other_run", f"rollout of run {rollout.run_id!r}, not {self.run_id!r}", rollout)
        if rollout.is_eval:
            return Verdict("dead", "eval_rollout", "evaluation rollouts are never trained", rollout)
        task = _text(fields.get(b"task"))
        lease = _text(fields.get(b"lease"))
        if not lease or stamps.get(task) != lease:
            return Verdict(
                "dead",
                "no_lease",
                f"entry for task {task!r} was not published by the lease that "
                f"completed it ({lease!r} vs {stamps.get(task)!r})",
                rollout,
            )
        if rollout.task_id != task:
            return Verdict(
                "dead", "task_mismatch", f"rollout of task {rollout.task_id!r} under the lease of {task!r}", rollout
            )
        if rollout.rollout_id in trained:  # whatever this copy holds, the rollout is trained already
            return Verdict("trained", rollout=rollout)
        if rollout.rollout_id in untrained:
            return Verdict("duplicate", rollout=rollout)
        held = self.groups.get(rollout.group_id, {}).get(rollout.sample_index)
        if held is not None and held.rollout.rollout_id == rollout.rollout_id:
            return Verdict("again" if held.entry == entry else "duplicate", rollout=rollout)
        try:
            if not sure:
                validate_rollout(rollout, replace(self.limits, max_version=version))
        except RolloutError as exc:
            return self._poison(rollout, exc.reason, str(exc))
        if self.require_teacher and rollout.teacher_logprobs is None:
            return self._poison(rollout, "no_teacher_logprobs", "distillation needs the teacher pool's logprobs")
        k = 0 if rollout.teacher_top_ids is None else rollout.teacher_top_ids.shape[1]
        if self.teacher_top_k and k != self.teacher_top_k:
            return self._poison(
                rollout, "teacher_top_k", f"distill.top_k is {self.teacher_top_k}; the rollout carries the top {k}"
            )
        if rollout.group_id in self.dead_groups:
            return Verdict("dead", "group_poisoned", f"group {rollout.group_id} was dead-lettered", rollout)
        problem = self._check_group(rollout, fields)
        if problem is not None:
            return self._poison(rollout, *problem)
        group = self.groups.setdefault(rollout.group_id, {})
        first = next(iter(group.values()), None)
        if first is not None and first.rollout.prompt_token_ids.tobytes() != rollout.prompt_token_ids.tobytes():
            return self._poison(rollout, "group_mismatch", "members of one group have different prompts")
        # validated: versions never decrease, so without a loss mask the first is the oldest
        oldest = int(rollout.policy_versions[0]) if rollout.loss_mask is None else rollout.min_version
        group[rollout.sample_index] = Held(entry, rollout, oldest)
        return Verdict("held", rollout=rollout)

    def prepare(self, entries: list, version: int) -> list[Prepared]:
        """Each entry of one read decoded (a dead Verdict when it cannot be) and whether its rollout
        surely passes validation against `version` (`surely_valid`: the numeric checks of the read
        made together; the others are validated one by one in `accept`)."""
        decoded = [self.decode(fields or {}) for _, fields in entries]
        rollouts = [d for d in decoded if isinstance(d, Rollout)]
        sure = iter(surely_valid(rollouts, replace(self.limits, max_version=version)))
        return [(d, next(sure)) if isinstance(d, Rollout) else (d, False) for d in decoded]

    def decode(self, fields: dict[bytes, bytes]) -> Rollout | Verdict:
        data = fields.get(b"r")
        if data is None:
            return Verdict("dead", "missing_field", "stream entry has no 'r' field")
        try:
            return decode_rollout(data, self.limits)
        except RolloutError as exc:
            return Verdict("dead", exc.reason, str(exc))

    def _check_group(self, rollout: Rollout, fields: dict[bytes, bytes]) -> tuple[str, str] | None:
        g = self.group_size
        if rollout.group_size != g:
            return "group_size", f"group of {rollout.group_size}, the trainer trains groups of {g}"
        published = _text(fields.get(b"n"))
        if published != str(g):
            return "publication_size", f"published as one of {published or '?'} rollouts, a group is {g}"
        if rollout.rollout_id != f"{rollout.task_id}:{rollout.sample_index}":
            return "rollout_id", f"rollout id {rollout.rollout_id!r} is not task_id:sample_index"
        return None

    def _poison(self, rollout: Rollout, code: str, message: str) -> Verdict:
        gid = rollout.group_id
        self.dead_groups.add(gid)
        released = list(self.groups.pop(gid, {}).values())
        return Verdict("dead", code, message, rollout, released, gid)

    def complete(self) -> list[str]:
        """Groups holding all G members, oldest first."""
        return [gid for gid, members in self.groups.items() if len(members) == self.group_size]

    def equal_rewards(self, group_id: str) -> bool:
        """Whether every member of this held group got the same reward (zero advantage under every baseline)."""
        return self.equal(list(self.groups[group_id].values()))

    @staticmethod
    def equal(members: list[Held]) -> bool:
        return len({m.rollout.reward for m in members}) == 1

    def take(self, group_ids: list[str]) -> list[list[Held]]:
        """Remove and return these groups, each ordered by sample index."""
        return [[m for _, m in sorted(self.groups.pop(gid).items())] for gid in group_ids]

    def drop_stale(self, oldest_allowed: int) -> list[list[Held]]:
        """Remove and return the groups holding a token older than `oldest_allowed`."""
        stale = [
            gid for gid, members in self.groups.items() if min(m.oldest for m in members.values()) < oldest_allowed
        ]
        return [list(self.groups.pop(gid).values()) for gid in stale]


def _text(value: bytes | None) -> str:
    return value.decode(errors="replace") if value is not None else ""
