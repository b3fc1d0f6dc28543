"""From the stream into the group buffer: each entry's verdict carried out in Redis (hold,
acknowledge, dead-letter with its reason, drop as stale, filter a group with equal rewards), with
the trainer's counters."""

from __future__ import annotations

import logging

from prometheus_client import Counter

from services.trainer.checkpoint import TrainerState
from services.trainer.groups import GroupBuffer, Held, Verdict
from shared.rollouts.interfaces import RolloutSource
from shared.rollouts.record import encode_rollout

log = logging.getLogger("steadyrl.trainer")

DROPPED = Counter("steadyrl_trainer_rollouts_dropped_stale_total", "Rollouts dropped for staleness")
DEAD = Counter("steadyrl_trainer_rollouts_dead_lettered_total", "Rollouts sent to the dead-letter stream", ["reason"])
FILTERED = Counter(
    "steadyrl_trainer_groups_filtered_total", "Groups dynamic sampling filtered (equal rewards), not trained"
)
CAP_HIT = Counter(
    "steadyrl_trainer_dynamic_sampling_cap_hit_total",
    "Groups with equal rewards trained because the step's filter cap was reached",
)
NONFINITE = Counter(
    "steadyrl_trainer_nonfinite_steps_total",
    "Steps not applied because their inputs, loss or gradient norm were not finite (their rollouts dead-lettered)",
)
EXACT_MISMATCH = Counter(
    "steadyrl_trainer_exact_mismatch_steps_total",
    "Exact mode: steps not applied because a token's sampling logprob differed from the trainer's recompute",
)
DUPLICATES = Counter("steadyrl_trainer_rollouts_duplicate_total", "Rollouts delivered again and not retrained")
RESTORED = Counter(
    "steadyrl_trainer_ledger_restored_total",
    "Ledger entries written again after Redis came back without them (a lost AOF window)",
)


class Intake:
    def __init__(self, source: RolloutSource, buffer: GroupBuffer, state: TrainerState) -> None:
        self.source = source
        self.buffer = buffer
        self.state = state
        self.oldest_checkable = 0  # exact mode: the oldest version whose tokens this trainer can check (its start's)
        # ids this process settled untrained → "dropped" (stale) or "filtered" (restored into a ledger that lost them)
        self.untrained: dict[str, str] = {}
        self.examined: set[str] = set()  # complete groups dynamic sampling looked at (each once)
        self.filtered_this_step = 0  # groups filtered since the last step (the cap counts these)
        self.training: set[str] = set()  # rollout ids of the step under way: out of the buffer, not yet trained

    def count(self, name: str, amount: int = 1) -> None:
        self.state.counters[name] = self.state.counters.get(name, 0) + amount

    async def take(self, entries: list, claimed: bool = False) -> None:
        """Give every entry its verdict and settle what is not held."""
        stamps = await self.source.stamps(entries)
        prepared = self.buffer.prepare(entries, self.state.version)
        for (entry, fields), ready in zip(entries, prepared, strict=True):
            verdict = self.buffer.accept(
                entry,
                fields,
                stamps,
                self.state.version,
                self.state.consumed,
                _Either(self.untrained, self.training),
                ready,
            )
            if verdict.kind == "dead":
                await self.dead_letter(entry, (fields or {}).get(b"r", b""), verdict)
            elif verdict.kind in ("trained", "duplicate"):
                rid = verdict.rollout.rollout_id
                if verdict.kind == "trained" and claimed:  # the crash hit between checkpoint and XACK
                    await self.source.trained([(entry, rid)])
                    continue
                await self.source.duplicates([(entry, rid)])
                DUPLICATES.inc()
                self.count("duplicates")

    async def claim_all(self) -> int:
        """Take over every entry delivered to a consumer but never acknowledged."""
        start = "0-0"
        claimed = 0
        while True:
            start, entries = await self.source.claim(start)
            await self.take(entries, claimed=True)
            claimed += len(entries)
            if start in (b"0-0", "0-0"):
                return claimed

    async def dead_letter(self, entry: bytes, payload: bytes, verdict: Verdict) -> None:
        await self.source.dead_letter(entry, verdict.code, verdict.message, payload, verdict.group)
        self._dead(entry, verdict.code, verdict.message)
        for held in verdict.released:  # the rest of a poisoned group
            message = f"group {verdict.group} poisoned by {verdict.code}: {verdict.message}"
            await self.source.dead_letter(
                held.entry, "group_poisoned", message, encode_rollout(held.rollout), verdict.group
            )
            self._dead(held.entry, "group_poisoned", message)

    def _dead(self, entry: bytes, code: str, message: str) -> None:
        DEAD.labels(code).inc()
        self.count("dead_lettered")
        log.warning("event=rollout_dead_lettered entry=%s reason=%s message=%s", entry.decode(), code, message[:200])

    async def not_applied(self, groups: list[list[Held]], code: str, reason: str) -> None:
        """A step that was not applied (`code`: nonfinite_step, or exact_mismatch in exact mode): its
        rollouts dead-lettered with the reason (payloads kept for a look), their groups dead, the step
        counted (`<code>s`). The model is as it was before it."""
        {"nonfinite_step": NONFINITE, "exact_mismatch": EXACT_MISMATCH}.get(code, NONFINITE).inc()
        self.count(f"{code}s")
        log.error("event=%s rollouts=%d reason=%s", code, sum(map(len, groups)), reason)
        for members in groups:
            gid = members[0].rollout.group_id
            self.buffer.dead_groups.add(gid)
            for m in members:
                message = f"step not applied: {reason}"
                await self.source.dead_letter(m.entry, code, message, encode_rollout(m.rollout), gid)
                self._dead(m.entry, code, message)
        self.training = set()

    async def drop_stale(self, max_staleness: int) -> None:
        """Whole groups whose oldest token is more than max_staleness versions behind are dropped, and in
        exact mode those older than `oldest_checkable` (sampled by a version whose weights this trainer
        never held: before its restart), which it could not compare bit for bit."""
        for members in self.buffer.drop_stale(max(self.state.version - max_staleness, self.oldest_checkable)):
            await self.source.dropped([(m.entry, m.rollout.rollout_id) for m in members])
            self.untrained.update((m.rollout.rollout_id, "dropped") for m in members)
            DROPPED.inc(len(members))
            self.count("dropped_stale", len(members))

    async def filter_equal(self, cap: int) -> None:
        """Dynamic sampling: complete groups with equal rewards are acknowledged as filtered, at most
        `cap` of them per step (`filtered_this_step`; `Trainer` resets it); past the cap they stay,
        to be trained (a warning). Each complete group is examined once."""
        for gid in self.buffer.complete():
            if gid in self.examined:
                continue
            self.examined.add(gid)
            if not self.buffer.equal_rewards(gid):
                continue
            if self.filtered_this_step >= cap:
                CAP_HIT.inc()
                self.count("filter_cap_hit")
                log.warning("event=dynamic_sampling_cap_hit group=%s cap=%d", gid, cap)
                continue
            (members,) = self.buffer.take([gid])
            self.examined.discard(gid)
            await self.source.filtered([(m.entry, m.rollout.rollout_id) for m in members])
            self.untrained.update((m.rollout.rollout_id, "filtered") for m in members)
            self.filtered_this_step += 1
            FILTERED.inc()
            self.count("filtered_groups")

    def next_step(self) -> None:
        """A step took its groups: forget the groups gone from the buffer, and a new filter allowance."""
        self.examined.intersection_update(self.buffer.groups)
        self.filtered_this_step = 0

    async def reconcile(self, unacknowledged: set[str]) -> None:
        """Redis restarted. With appendfsync everysec a host crash loses up to the last second of
        acknowledged writes, here acknowledgements and ledger entries of trained rollouts: claim
        what is pending again, then write back every checkpointed id and every id dropped as stale
        or filtered that the ledger lacks (else the orchestrator counts those tasks outstanding forever)."""
        claimed = await self.claim_all()
        acked = sorted(self.state.consumed - unacknowledged)
        restored = 0
        for start in range(0, len(acked), 4096):
            restored += await self.source.trained([("", rid) for rid in acked[start : start + 4096]])
        for mode, settle in (("dropped", self.source.dropped), ("filtered", self.source.filtered)):
            ids = sorted(rid for rid, how in self.untrained.items() if how == mode)
            for start in range(0, len(ids), 4096):
                restored += await settle([("", rid) for rid in ids[start : start + 4096]])
        RESTORED.inc(restored)
        self.count("ledger_restored", restored)
        log.warning("event=redis_restarted claimed=%d ledger_restored=%d", claimed, restored)


class _Either:
    """Membership in either of two containers (a copy of a rollout the step under way trains is a
    duplicate, like one dropped or filtered)."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __contains__(self, item: object) -> bool:
        return item in self.first or item in self.second
