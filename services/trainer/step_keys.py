"""Every key a line of the trainer's metrics.jsonl can carry, declared once with its unit and
meaning: the metrics reference (docs/reference/metrics.md) is generated from this, and the suite
fails on a key a step writes that is not declared here. Keys with a part that varies (a staleness
bucket, a data source, an environment count) are declared as templates."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class StepKey:
    name: str  # the key, or a template with one <part>: `mismatch_kl_k3_s<k>`
    unit: str
    meaning: str
    when: str = "every step"

    @property
    def pattern(self) -> re.Pattern:
        literal = re.split(r"<[a-z]+>", self.name)
        parts = re.findall(r"<([a-z]+)>", self.name)
        body = "".join(re.escape(text) + (PARTS[parts[i]] if i < len(parts) else "") for i, text in enumerate(literal))
        return re.compile(body + r"\Z")


PARTS = {"k": r"[0-9]+", "name": r"[A-Za-z0-9_.\-]+"}  # what each template part matches

IDENTITY = (
    StepKey("step", "count", "The global step this line is for (1, 2, ...); exactly one line per step trained."),
    StepKey("version", "count", "The policy version the step produced (the version its weights are published as)."),
    StepKey(
        "recipe",
        "text",
        "The objective the step ran, spelled out: `minirl+tis+clip+r2` and the like (auto: chosen per step).",
    ),
    StepKey("unix_ms", "ms since the epoch", "When the line was written (wall clock, UTC)."),
)

REWARD = (
    StepKey("reward_mean", "reward", "Mean reward of the step's rollouts whose reward scored."),
    StepKey(
        "reward_failures",
        "fraction",
        "Share of the step's rollouts whose reward failed after its retries (left out of the loss).",
    ),
    StepKey("reward_excluded", "rollouts", "Rollouts of the step left out of the loss because their reward failed."),
    StepKey(
        "zero_variance_share",
        "fraction",
        "Share of the step's groups whose rewards were all equal (their advantages are 0: no signal).",
    ),
    StepKey("advantage_mean", "advantage", "Token-weighted mean advantage over the step's valid tokens."),
    StepKey(
        "truncated_frac",
        "fraction",
        "Share of the step's rollouts that ran out of tokens (finish reason `length`).",
    ),
    StepKey(
        "filtered_groups",
        "groups",
        "Groups dynamic sampling filtered out (all rewards equal) while this step's batch filled.",
        "with `trainer.dynamic_sampling.enabled`",
    ),
    StepKey(
        "filtered_share",
        "fraction",
        "filtered_groups / (filtered_groups + the groups trained).",
        "with `trainer.dynamic_sampling.enabled`",
    ),
    StepKey(
        "judge_agreement",
        "fraction",
        "Share of judged rollouts where the judge's reward and the comparison rule's are both ≥ 0.5 or both below.",
        "with a judge pool and `compare_with`",
    ),
    StepKey(
        "judge_reference_reward_mean",
        "reward",
        "Mean reward the comparison rule gave the judged rollouts.",
        "with a judge pool and `compare_with`",
    ),
    StepKey(
        "source/<name>/reward_mean",
        "reward",
        "Mean reward (of those that scored) of the step's rollouts from data source NAME.",
        "in a data mixture",
    ),
    StepKey("source/<name>/rollouts", "rollouts", "The step's rollouts from data source NAME.", "in a data mixture"),
)

OBJECTIVE = (
    StepKey("loss", "loss", "The objective's value summed over the step's mini-batches (and ranks)."),
    StepKey("entropy", "nats per token", "Token entropy of π on the sampled prefixes: collapse comes with it falling."),
    StepKey(
        "mismatch_kl_k1",
        "nats per token",
        "KL(μ_old ‖ π_old) estimated on the sampled tokens with k1 = E_μ[log μ − log π].",
    ),
    StepKey(
        "mismatch_kl_k3",
        "nats per token",
        "The same KL with k3 = E_μ[(π/μ − 1) − log(π/μ)] (non-negative, lower variance).",
    ),
    StepKey("is_weight_mean", "weight", "Mean importance-sampling weight w_t over the valid tokens (after its cap)."),
    StepKey("is_weight_max", "weight", "Largest IS weight of the step."),
    StepKey(
        "exact_tokens",
        "tokens",
        "Tokens whose sampling logprob equalled, bit for bit, the trainer's recompute under the version that "
        "sampled them (the step's own version in its forward, older ones with their kept weights). A token that "
        "differs stops the step: ExactMismatch, naming it.",
        "exact mode (run.exact)",
    ),
    StepKey(
        "exact_unchecked_tokens",
        "tokens",
        "Tokens of an older version whose weights the trainer no longer holds (the versions before a restart): "
        "not compared.",
        "exact mode (run.exact)",
    ),
    StepKey(
        "is_identity",
        "0 or 1",
        "1 when every token of the step was checked bit for bit (exact mode, staleness 0): every IS weight is "
        "exactly 1, the correction computed and the identity; 0 when older tokens carry a staleness correction.",
        "exact mode (run.exact)",
    ),
    StepKey("is_truncated_frac", "fraction", "Share of valid tokens whose IS weight the cap truncated."),
    StepKey(
        "importance_ratio_mean", "ratio", "Mean ratio π_θ / π_old over the valid tokens (1 on a step's first update)."
    ),
    StepKey("clip_frac", "fraction", "Share of valid tokens the clipping mask M_t removed."),
    StepKey("rejected_frac", "fraction", "Share of valid tokens a rejection mask (MIS, geometric, IcePop) dropped."),
    StepKey(
        "first_order_error",
        "ratio",
        "Mean over responses of |Π_t ρ_t − (1 + Σ_t (ρ_t − 1))|: how far the token surrogate is from the "
        "sequence objective.",
    ),
    StepKey(
        "routing_agreement",
        "fraction",
        "Share of (token, layer) top-k expert sets on which the trainer agrees with the inference engine's trace.",
    ),
    StepKey("grad_norm", "norm", "Global gradient norm before clipping, mean over the step's updates."),
    StepKey("grad_norm_max", "norm", "Largest global gradient norm of the step's updates."),
    StepKey("lr", "learning rate", "The step's learning rate (after warm-up and schedule)."),
    StepKey("tokens", "tokens", "Completion tokens in the loss (the loss mask's count)."),
    StepKey("valid_tokens", "tokens", "Tokens whose terms were finite and entered the loss."),
    StepKey(
        "nonfinite_tokens",
        "tokens",
        "Tokens in the loss mask left out because a term (log-probability, weight) was not finite.",
    ),
    StepKey(
        "ref_kl",
        "nats per token",
        "KL to the frozen reference model per token (before its coefficient).",
        "with `trainer.loss.kl_coef` > 0",
    ),
    StepKey(
        "ref_kl_penalty",
        "reward",
        "The KL penalty per sequence (coefficient included).",
        "with `trainer.loss.kl_coef` > 0",
    ),
    StepKey(
        "teacher_kl",
        "nats per token",
        "Mean reverse KL to the teacher's distribution per token (the distillation term's normaliser).",
        "with a teacher pool",
    ),
    StepKey(
        "teacher_gap",
        "nats per token",
        "Mean of log π_teacher − log μ over the sampled tokens (the reverse KL's sample, negated).",
        "with a teacher pool",
    ),
)

STALENESS = (
    StepKey("staleness_mean", "versions", "Mean versions between the trainer and each token's sampler."),
    StepKey("staleness_peak", "versions", "Most versions any token of the step was behind."),
    StepKey("dropped_stale", "tasks", "Tasks dropped as staler than the budget since the run started (cumulative)."),
    StepKey("staleness_tokens_s<k>", "tokens", "Tokens sampled k versions behind the trainer."),
    StepKey("mismatch_kl_k3_s<k>", "nats per token", "mismatch_kl_k3 over the tokens k versions behind."),
    StepKey("is_weight_mean_s<k>", "weight", "is_weight_mean over the tokens k versions behind."),
)

TIME = (
    StepKey(
        "step_seconds", "s", "Wall time of the step, from its start to its line (checkpoint and publish after it)."
    ),
    StepKey("tokens_per_s", "tokens/s", "tokens / step_seconds."),
    StepKey("collate_seconds", "s", "Building the step's batch from its rollouts."),
    StepKey("plan_seconds", "s", "Planning the step's mini- and micro-batches."),
    StepKey("old_logprobs_seconds", "s", "Computing π_old's log-probabilities."),
    StepKey(
        "reference_seconds",
        "s",
        "The reference model's forward passes.",
        "with `trainer.loss.kl_coef` > 0",
    ),
    StepKey("update_seconds", "s", "Forward, backward and optimizer steps (loss_seconds is inside it)."),
    StepKey("loss_seconds", "s", "Computing the objective, mean per rank."),
    StepKey("diagnostics_seconds", "s", "Reducing and reading the step's statistics."),
    StepKey(
        "checkpoint_seconds",
        "s",
        "The previous step's checkpoint (it follows that step's line, so it lands in the next).",
        "from the second step",
    ),
    StepKey(
        "publish_seconds",
        "s",
        "The previous step's weight publication (lands in the next line, like checkpoint_seconds).",
        "from the second step",
    ),
    StepKey(
        "trainer_wait_seconds",
        "s",
        "Time the trainer waited for rollouts between the previous step's end and this step's start.",
    ),
    StepKey(
        "trainer_idle_share",
        "fraction",
        "trainer_wait_seconds / the time since the previous step started.",
    ),
    StepKey(
        "replica_idle_share",
        "fraction",
        "The replicas' mean idle share from their heartbeats.",
        "once a replica has sent a heartbeat",
    ),
)

TRAJECTORY = (
    StepKey("turns_mean", "turns", "Model turns per trajectory.", "multi-turn runs"),
    StepKey("turn_tokens_mean", "tokens", "Model tokens per turn.", "multi-turn runs"),
    StepKey("env_tokens_fraction", "fraction", "Share of completion tokens the environment wrote.", "multi-turn runs"),
    StepKey(
        "trajectories_done",
        "fraction",
        "Share of trajectories that ended done (not cut by a budget).",
        "multi-turn runs",
    ),
    StepKey(
        "env_<name>",
        "per trajectory",
        "The environment's count NAME (e.g. `env_tool_success`), mean per trajectory (0 where it has none).",
        "multi-turn runs",
    ),
)

GROUPS = {
    "Identity": IDENTITY,
    "Reward and data": REWARD,
    "Objective and mismatch": OBJECTIVE,
    "Staleness": STALENESS,
    "Time": TIME,
    "Multi-turn": TRAJECTORY,
}
STEP_KEYS: tuple[StepKey, ...] = tuple(k for group in GROUPS.values() for k in group)


def declaration(key: str) -> StepKey | None:
    """The declaration `key` falls under (a literal first, then a template), None for none."""
    for k in STEP_KEYS:
        if k.name == key:
            return k
    return next((k for k in STEP_KEYS if "<" in k.name and k.pattern.match(key)), None)


def undeclared(keys) -> list[str]:
    """The keys among `keys` that no declaration covers, sorted."""
    return sorted(k for k in set(keys) if declaration(k) is None)
