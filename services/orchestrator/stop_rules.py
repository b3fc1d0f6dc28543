"""When a run that can only fail is failed, rather than left to spin: no step trained for a while
as train tasks keep dying, most of the last train tasks dead-lettered, or most of the last steps'
rewards failing. The orchestrator asks every tick while the run is running (`StopWatch.observe`);
a verdict fails the run with its reason (the run hash, GET /v1/run, `summary.json`, exit 1 of
`steadyrl run`, the alert SteadyrlRunFailed). The thresholds are settings (`StopRules`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class StopRules(BaseModel):
    """[orchestrator.stop]: when a run is failed instead of left to spin."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    stalled_seconds: float = Field(600.0, ge=0)
    """Fail the run when no step has been trained for this long while train tasks kept being
    dead-lettered (0: never)."""
    dead_share: float = Field(0.9, gt=0, le=1)
    """Fail the run when at least this share of the last `window_tasks` train tasks that ended
    (trained or dead-lettered) were dead-lettered."""
    window_tasks: int = Field(200, ge=1)
    """Train tasks `dead_share` looks back over (it judges once that many have ended)."""
    reward_failure_share: float = Field(0.9, gt=0, le=1)
    """Fail the run when, over the last `window_steps` steps, the rewards of at least this share of
    the trained rollouts failed (raised, timed out, not a finite number: each scored 0)."""
    window_steps: int = Field(10, ge=1)
    """Steps `reward_failure_share` looks back over."""


@dataclass(frozen=True)
class Verdict:
    rule: str  # stalled | dead_share | reward_failures
    reason: str


@dataclass(frozen=True)
class Sample:
    seconds: float  # monotonic
    ended: int  # train tasks trained or dead-lettered
    dead: int
    step: int


class StopWatch:
    """The run's recent history as the orchestrator sees it tick by tick; `observe` says when a
    rule is broken. Pure: the caller gives the clock and the counts."""

    def __init__(self, rules: StopRules) -> None:
        self.rules = rules
        self.samples: deque[Sample] = deque()
        self.progress_at: Sample | None = None  # the first sample of the current step
        self.rewards: dict[int, float] = {}  # step → share of its rollouts whose reward failed

    def observe(self, seconds: float, trained: int, dead: int, step: int, metrics: dict[str, float]) -> Verdict | None:
        now = Sample(seconds, trained + dead, dead, step)
        if self.progress_at is None or step != self.progress_at.step:
            self.progress_at = now
        self.samples.append(now)
        if "reward_failures" in metrics and "step" in metrics:
            self.rewards[int(metrics["step"])] = float(metrics["reward_failures"])
            for old in sorted(self.rewards)[: -self.rules.window_steps]:
                del self.rewards[old]
        return self._stalled(now) or self._dead_share(now) or self._reward_failures()

    def _stalled(self, now: Sample) -> Verdict | None:
        since = self.progress_at
        rules = self.rules
        if not rules.stalled_seconds or now.seconds - since.seconds < rules.stalled_seconds or now.dead <= since.dead:
            return None
        return Verdict(
            "stalled",
            f"no step trained for {now.seconds - since.seconds:.0f} s (since step {now.step}) "
            f"while {now.dead - since.dead} train tasks were dead-lettered",
        )

    def _dead_share(self, now: Sample) -> Verdict | None:
        window = self.rules.window_tasks
        while len(self.samples) > 1 and now.ended - self.samples[1].ended >= window:
            self.samples.popleft()  # the newest sample that still spans the window is kept first
        first = self.samples[0]
        ended = now.ended - first.ended
        if ended < window:
            return None
        share = (now.dead - first.dead) / ended
        if share < self.rules.dead_share:
            return None
        return Verdict(
            "dead_share",
            f"{now.dead - first.dead} of the last {ended} train tasks were dead-lettered "
            f"({share:.0%} >= {self.rules.dead_share:.0%}); see the dead letters' reasons",
        )

    def _reward_failures(self) -> Verdict | None:
        if len(self.rewards) < self.rules.window_steps:
            return None
        share = sum(self.rewards.values()) / len(self.rewards)
        if share < self.rules.reward_failure_share:
            return None
        return Verdict(
            "reward_failures",
            f"the reward failed on {share:.0%} of the rollouts of the last "
            f"{len(self.rewards)} steps (>= {self.rules.reward_failure_share:.0%}); "
            "see the replicas' reward_failed events",
        )
