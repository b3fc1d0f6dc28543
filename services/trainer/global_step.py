"""One global step of the training engine: π_old, the N updates (each in micro-batches), the
statistics. Batches are laid out by `services.trainer.batch`; forwards run in `services.trainer.forward`."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from services.trainer.batch import TrainBatch, split_groups, token_budget_chunks
from services.trainer.forward import Compute, Forward, gradient_sync, routing_context, sequence_logprobs
from services.trainer.step_config import StepConfig
from shared.core.advantages import group_advantages
from shared.core.distillation import distillation_advantages, top_k_kl
from shared.core.loss import policy_loss
from shared.core.reference_kl import reward_penalty
from shared.core.stats import StepStats
from shared.core.terms import normalise
from shared.models.routing import RoutingController


class StepNotApplied(RuntimeError):
    """A step not applied, the model and the optimizer as they were before it: its rollouts are
    dead-lettered with `code` and the reason (docs/internals/trainer.md)."""

    code = "not_applied"

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NonFiniteStep(StepNotApplied):
    """Its inputs, loss or gradient norm were not finite."""

    code = "nonfinite_step"


class ExactMismatch(StepNotApplied):
    """Exact mode: a token's sampling logprob and the trainer's recompute of it at the same version
    differ (raised before any update). Not a statistic: the batch-invariant forwards promise equal
    bits, so the step is not applied and its rollouts are dead-lettered naming the token
    (docs/guides/exact.md)."""

    code = "exact_mismatch"


def check_exact(
    logprobs: torch.Tensor, part: TrainBatch, staleness: torch.Tensor, version: int, stats: StepStats
) -> None:
    """Exact mode: `logprobs` ([rows, S − 1], π at `version` of `part`'s rows) equal μ bit for bit on
    every completion token sampled by `version` (staleness 0; an older token's difference is the
    staleness, not a mismatch), else ExactMismatch naming the first token that differs."""
    checked = part.loss_mask.to(logprobs.device) & (staleness.to(logprobs.device) == 0)
    width = min(logprobs.shape[1], checked.shape[1])
    checked = checked[:, :width]
    mine = logprobs[:, :width].detach()
    sampled = part.inference_logprobs[:, :width].to(logprobs.device)
    differs = checked & (mine != sampled)
    stats.add_total("exact_tokens", checked.sum())
    if bool(differs.any()):
        row, position = (int(i) for i in differs.nonzero()[0])
        first = int(part.loss_mask[row].nonzero()[0])  # the completion's first token sits here
        count = int(differs.sum())
        raise ExactMismatch(
            f"exact mode: rollout {part.rollout_ids[row]} completion token {position - first} "
            f"(id {int(part.input_ids[row, position + 1])}, version {version}) was sampled with logprob "
            f"{float(sampled[row, position]).hex()} and the trainer computes {float(mine[row, position]).hex()} "
            f"({count} token(s) of this batch differ)"
        )


class Snapshot:
    """The trainable parameters and the optimizer's state as they were, on the CPU, to undo the
    updates of a step whose later mini-batch turned out non-finite (N > 1 only: one update is
    checked before it is applied)."""

    def __init__(self, model, optimizer) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.saved = [p.detach().to("cpu", copy=True) for p in self.params]
        self.optimizer_state = copy.deepcopy(optimizer.state_dict())

    @torch.no_grad()
    def restore(self, optimizer) -> None:
        for param, saved in zip(self.params, self.saved, strict=True):
            param.copy_(saved.to(param.device))
        optimizer.state.clear()  # the state entries the undone updates made go too
        optimizer.load_state_dict(self.optimizer_state)


def resolve_recipe(mini_batches: int, staleness_peak: int, has_traces: bool) -> tuple[str, bool, str]:
    """The paper's recipe (§4 of arXiv 2512.01374: on-policy MiniRL; N = 2 clipping + R2;
    N ≥ 4 or async staleness ≥ 2 clipping + R3) → (replay, clip, why)."""
    if mini_batches >= 4 or staleness_peak >= 2:
        if has_traces:
            return "r3", True, f"strongly off-policy (N={mini_batches}, staleness {staleness_peak}): clip + R3"
        return (
            "r2",
            True,
            f"strongly off-policy (N={mini_batches}, staleness {staleness_peak}) but no traces: clip + R2",
        )
    if mini_batches >= 2 or staleness_peak >= 1:
        return "r2", True, f"mildly off-policy (N={mini_batches}, staleness {staleness_peak}): clip + R2"
    return "off", True, "on-policy (N=1, staleness 0): MiniRL + TIS, no replay"


STALE_DPPO = 4
"""The run's max_staleness from which the auto recipe trains DPPO instead of MiniRL: in the objective
arena, staleness up to 4 and up to 8 collapsed MiniRL's runs and not DPPO's (docs/REPRODUCTION.md)."""


def resolve_objective(objective: str, max_staleness: int) -> tuple[str, str]:
    """The auto recipe's objective for the run → (objective, why): the default MiniRL becomes DPPO
    from max_staleness STALE_DPPO on (the objective arena's finding); an objective the recipe chose
    otherwise stays. Once per run, from the bound, not per step."""
    if objective == "minirl" and max_staleness >= STALE_DPPO:
        return "dppo", f"max_staleness {max_staleness} >= {STALE_DPPO}: DPPO (the objective arena)"
    return objective, ""


def _global_sum(value: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value)
    return value


def reduce_stats(stats: StepStats, world: int) -> None:
    """Merge every rank's StepStats: sums and counts added, maxima the largest (same keys on
    every rank: they come from the same code on the same global batch)."""
    if world <= 1:
        return
    import torch.distributed as dist

    additive, maxima = stats.as_tensors()
    dist.all_reduce(additive)
    if maxima.numel():
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    stats.load_tensors(additive, maxima)


@dataclass
class StepPlan:
    """A global step laid out: advantages of the whole batch, this rank's rows of each mini-batch."""

    batch: TrainBatch
    advantages: torch.Tensor  # [B] over the whole global batch ([B, S-1] per token when distilling)
    staleness: torch.Tensor  # [B, S-1] float: version − token version (0 off the mask)
    rows_of: list[list[int]]  # per mini-batch: this rank's rows of `batch`
    local: TrainBatch  # this rank's rows of every mini-batch, in order
    position: dict[int, int]  # row of `batch` → row of `local`
    buckets: list[int]  # staleness buckets present in the global batch
    version: int = 0  # the version the step trains (the model's before its updates)
    local_rows: list[int] | None = None  # row of `local` → row of `batch`


def plan_step(
    batch: TrainBatch,
    group_size: int,
    config: StepConfig,
    routing: RoutingController | None,
    version: int,
    rank: int,
    world: int,
) -> StepPlan:
    if batch.size % group_size:
        raise ValueError(f"{batch.size} rows are not whole groups of {group_size}")
    if config.replay == "r3" and batch.trace is None:
        raise ValueError("R3 needs a routing trace on every rollout")
    if config.replay != "off" and not (routing is not None and routing.is_moe):
        raise ValueError(f"routing replay {config.replay} needs an MoE model")
    advantages = step_advantages(batch, batch.rewards, group_size, config)
    staleness = torch.where(batch.loss_mask, (version - batch.versions).clamp(min=0), 0).float()
    rows_of = [rows[rank::world] for rows in split_groups(batch.size // group_size, group_size, config.mini_batches)]
    if any(not rows for rows in rows_of):
        raise ValueError(f"a mini-batch has fewer rows than the {world} ranks")
    mine = [row for rows in rows_of for row in rows]
    buckets = sorted({int(x) for x in staleness[batch.loss_mask].tolist()}) if batch.loss_mask.any() else []
    return StepPlan(
        batch,
        advantages,
        staleness,
        rows_of,
        batch.select(mine),
        {row: i for i, row in enumerate(mine)},
        buckets,
        version,
        mine,
    )


def step_advantages(batch: TrainBatch, rewards: torch.Tensor, group_size: int, config: StepConfig) -> torch.Tensor:
    """The step's advantages: the group baseline's [B] from `rewards`, or with distillation [B, S-1]
    per token (the teacher's log-ratio against μ, plus the task's by its weight)."""
    scored = None if batch.scored is None else batch.scored.view(-1, group_size)
    sequence = group_advantages(rewards.view(-1, group_size), config.advantage, scored=scored).reshape(-1)
    if not config.distills:
        return sequence
    if batch.teacher_logprobs is None:
        raise ValueError("distillation needs the teacher's logprobs on every rollout")
    return distillation_advantages(
        batch.teacher_logprobs,
        batch.inference_logprobs,
        batch.loss_mask,
        config.distill_coef,
        sequence,
        config.distill_reward_weight,
        config.distill_max_gap,
    )


@dataclass
class OldPolicy:
    """π_old of this rank's rows (None in bypass mode, or when the update's forward gives it:
    `fused`) and what the recompute routed by (R2)."""

    logprobs: torch.Tensor | None
    routing: torch.Tensor | None
    fused: bool = False
    reference: torch.Tensor | None = None  # log π_ref of this rank's rows (a KL to the reference)


def record_agreement(stats: StepStats, own: torch.Tensor, part: TrainBatch) -> None:
    """The share of (token, layer) whose training experts equal the inference trace's, as sets."""
    same = (own.sort(dim=-1).values == part.trace.sort(dim=-1).values).all(dim=-1)  # [B, S, L]
    stats.add_mean("routing_agreement", same, part.trace_mask.unsqueeze(-1).expand_as(same))


@torch.no_grad()
def recompute_old(
    model, plan: StepPlan, routing: RoutingController | None, config: StepConfig, stats: StepStats, compute: Compute
) -> OldPolicy:
    """log π_old once per global step, before any update, replaying R3 traces or capturing the
    routing for R2, in micro-batches; records the routing agreement with the inference traces."""
    if config.fuses_old:
        return OldPolicy(None, None, fused=True)
    local = plan.local
    is_moe = routing is not None and routing.is_moe
    width = local.width
    device = compute.device
    logprobs = torch.zeros(local.size, width - 1, device=device) if not config.bypass else None
    captured = None
    for chunk in token_budget_chunks(local.lengths().tolist(), compute.micro_batch_tokens):
        part = local.select(chunk).trimmed().to(device)
        at = torch.tensor(chunk, device=device)
        own = None
        if not config.bypass:
            r3 = config.replay == "r3"
            forward = sequence_logprobs(
                model,
                part,
                routing,
                replay=part.trace if r3 else None,
                replay_mask=part.trace_mask if r3 else None,
                capture=is_moe and not r3,
                compute=compute,
            )
            logprobs[at, : part.width - 1] = forward.logprobs
            if config.exact:
                staleness = plan.staleness.index_select(0, torch.tensor([plan.local_rows[i] for i in chunk]))
                check_exact(forward.logprobs, part, staleness[:, : part.width - 1], plan.version, stats)
            own = forward.routing
            if own is not None:
                if captured is None:
                    captured = torch.zeros(local.size, width, *own.shape[2:], dtype=own.dtype, device=device)
                captured[at, : part.width] = own
        if is_moe and part.trace is not None:
            inner = getattr(model, "module", model)
            if own is None:
                own = sequence_logprobs(inner, part, routing, capture=True, compute=compute).routing
            record_agreement(stats, own, part)
    return OldPolicy(logprobs, captured)


@torch.no_grad()
def reference_logprobs(reference, plan: StepPlan, compute: Compute) -> torch.Tensor:
    """log π_ref [local rows, S − 1] of this rank's rows, from the frozen reference, in micro-batches
    (under FSDP every rank runs the same chunks as its π_old recompute)."""
    local = plan.local
    out = torch.zeros(local.size, local.width - 1, device=compute.device)
    for chunk in token_budget_chunks(local.lengths().tolist(), compute.micro_batch_tokens):
        part = local.select(chunk).trimmed().to(compute.device)
        out[torch.tensor(chunk, device=compute.device), : part.width - 1] = sequence_logprobs(
            reference, part, compute=compute
        ).logprobs
    return out


def kl_in_reward(
    plan: StepPlan, reference: torch.Tensor, group_size: int, config: StepConfig, stats: StepStats, world: int
) -> None:
    """KL in the reward: every sequence's reward loses β · Σ_t k(log μ_old, log π_ref) (this rank
    its rows, summed over ranks), and the advantages are formed again from what is left."""
    local = plan.local
    mask = local.loss_mask.to(reference.device) & torch.isfinite(local.inference_logprobs).to(reference.device)
    mu = local.inference_logprobs.to(reference.device)
    loss = config.loss
    penalty_local = reward_penalty(mu, reference, mask, loss.kl_estimator, loss.kl_coef)
    penalty = torch.zeros(plan.batch.size, device=reference.device)
    penalty[torch.tensor(list(plan.position), device=reference.device)] = penalty_local
    penalty = _global_sum(penalty, world).cpu()
    plan.advantages = step_advantages(plan.batch, plan.batch.rewards - penalty, group_size, config)
    stats.add_sum("ref_kl", penalty_local.sum() / loss.kl_coef, mask.sum())  # per token: the sum before β
    stats.add_sum("ref_kl_penalty", penalty_local.sum(), local.size)  # per sequence


def advantages_of(plan: StepPlan, rows: list[int], width: int) -> torch.Tensor:
    """The advantages of these rows of the batch ([rows], or [rows, width − 1] per token)."""
    picked = plan.advantages.index_select(0, torch.tensor(rows))
    return picked[:, : width - 1] if picked.dim() == 2 else picked


def update(
    model,
    optimizer,
    routing: RoutingController | None,
    plan: StepPlan,
    old: OldPolicy,
    rows: list[int],
    config: StepConfig,
    stats: StepStats,
    world: int,
    compute: Compute,
    first: bool = True,
) -> None:
    """One optimizer step on `rows` (this rank's part of one mini-batch), its gradients
    accumulated over micro-batches of at most `compute.micro_batch_tokens` tokens. Every
    micro-batch divides by the mini-batch's normaliser (its valid tokens over all ranks), so the
    update equals the unsplit one. NonFiniteStep, the update not applied, when the loss on any
    rank or the global gradient norm is not finite."""
    whole = plan.batch.select(rows)
    counted = whole.loss_mask & torch.isfinite(whole.inference_logprobs)  # policy_loss drops the others
    tokens = _global_sum(counted.sum().to(compute.device), world)
    sequences = _global_sum(counted.any(dim=-1).sum().to(compute.device), world)
    chunks = token_budget_chunks(whole.lengths().tolist(), compute.micro_batch_tokens)
    optimizer.zero_grad(set_to_none=True)
    nonfinite_loss = torch.zeros((), device=compute.device)
    for i, chunk in enumerate(chunks):
        picked = [rows[j] for j in chunk]
        mb = plan.batch.select(picked).trimmed().to(compute.device)
        w = mb.width
        at = torch.tensor([plan.position[row] for row in picked], device=compute.device)
        replay = replay_mask = None
        if config.replay == "r3":
            replay = mb.trace
            replay_mask = mb.trace_mask
        elif config.replay == "r2" and not old.fused:
            replay = old.routing.index_select(0, at)[:, :w]
            replay_mask = mb.attention_mask.bool()
        staleness = plan.staleness.index_select(0, torch.tensor(picked))[:, : w - 1].long().to(compute.device)
        agreement = old.fused and routing is not None and routing.is_moe and mb.trace is not None
        with gradient_sync(model, i == len(chunks) - 1), routing_context(routing, replay, replay_mask):
            # replay stays on through the backward; fused, the forward records its routing for the agreement
            bonus = config.loss.entropy_coef > 0
            top = config.distill_top_k_coef > 0
            forward = sequence_logprobs(
                model,
                mb,
                routing if agreement else None,
                capture=agreement,
                compute=compute,
                entropy_grad=bonus,
                teacher_top=top,
                share_prefix=replay is None,  # the replay context above covers one forward's tokens
            )
            if agreement:
                record_agreement(stats, forward.routing, mb)
            if config.exact and first and (old.fused or config.bypass):  # π at the step's version: this forward
                check_exact(forward.logprobs, mb, staleness, plan.version, stats)
            if old.fused:
                old_logprobs = forward.logprobs.detach()
            else:
                old_logprobs = None if old.logprobs is None else old.logprobs.index_select(0, at)[:, : w - 1]
            started = time.perf_counter()
            loss, _ = policy_loss(
                forward.logprobs,
                old_logprobs,
                mb.inference_logprobs,
                advantages_of(plan, picked, w).to(compute.device),
                mb.loss_mask,
                config.loss,
                token_normalizer=tokens,
                sequence_normalizer=sequences,
                stats=stats,
                buckets=(staleness, plan.buckets),
                entropy=forward.entropy_per_token if bonus else None,
                reference=None if old.reference is None else old.reference.index_select(0, at)[:, : w - 1],
            )
            if top:
                loss = loss + teacher_kl_loss(forward, mb, config, stats, tokens, sequences)
            stats.add_total("loss_seconds", time.perf_counter() - started)
            nonfinite_loss += (~torch.isfinite(loss.detach())).float()
            (loss * world).backward()
        stats.add_total("loss", loss.detach() / len(plan.rows_of))  # Σ over ranks, micro- and mini-batches
        stats.add_mean("entropy", forward.entropy_per_token.detach(), mb.loss_mask)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), config.grad_clip if config.grad_clip > 0 else float("inf")
    )
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
    losses_bad = float(_global_sum(nonfinite_loss, world))  # every rank decides alike
    if losses_bad or not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        what = "loss" if losses_bad else "gradient norm"
        raise NonFiniteStep(f"the {what} of a mini-batch is not finite (gradient norm {float(grad_norm):g})")
    optimizer.step()
    stats.add_sum("grad_norm", grad_norm / world, 1.0 / world)  # every rank holds the same global norm
    stats.add_max("grad_norm_max", grad_norm.reshape(1))


def teacher_kl_loss(
    forward: Forward, mb: TrainBatch, config: StepConfig, stats: StepStats, tokens, sequences
) -> torch.Tensor:
    """top_k_coef · the KL from the teacher's top-k distribution to π_θ's on the valid tokens, under
    the objective's normaliser (`teacher_kl`: its mean per token, in the step's metrics)."""
    if forward.top_logprobs is None or mb.teacher_top_logprobs is None:
        raise ValueError("distill.top_k needs the teacher's top-k on every rollout")
    valid = mb.loss_mask & torch.isfinite(mb.inference_logprobs)
    kl = top_k_kl(forward.top_logprobs, mb.teacher_top_logprobs)
    kl = torch.where(valid, kl, torch.zeros_like(kl))
    stats.add_mean("teacher_kl", kl.detach(), valid)
    return config.distill_top_k_coef * normalise(kl, valid, config.loss, tokens, sequences)


def check_inputs(plan: StepPlan, old: OldPolicy, world: int, device: torch.device) -> None:
    """NonFiniteStep before any update when what the loss is formed from is not finite on any rank:
    the advantages (rewards, a KL in the reward, a teacher's log-ratios), π_old, π_ref."""
    named = {"advantages": plan.advantages, "old logprobs": old.logprobs, "reference logprobs": old.reference}
    bad = torch.tensor([float(v is not None and not bool(torch.isfinite(v).all())) for v in named.values()])
    for name, flag in zip(named, _global_sum(bad.to(device), world).tolist(), strict=True):
        if flag:
            raise NonFiniteStep(f"the step's {name} are not all finite")


def train_step(
    model,
    optimizer,
    routing: RoutingController | None,
    batch: TrainBatch,
    group_size: int,
    config: StepConfig,
    version: int,
    rank: int = 0,
    world: int = 1,
    compute: Compute = Compute(),  # noqa: B008 - a frozen dataclass, read only
    reference=None,
) -> dict[str, float]:  # noqa: B008
    """One global step on `batch` (rows grouped G by G): advantages, π_old, N optimizer steps.

    Data parallel (`world` > 1, `model` wrapped in DistributedDataParallel): every rank holds the
    whole global batch, computes the advantages of all of it, and works on rows[rank::world] of
    each mini-batch; the loss normalisers are summed over ranks and the loss is scaled by `world`
    (DDP and FSDP average gradients), so the update equals one process on the whole batch.
    Returns the step's diagnostics: token-weighted over the whole step (every mini-batch, every
    rank), maxima as maxima, and per staleness bucket `_s<k>` (k versions behind). `reference`: the
    frozen reference model of a KL term (config.loss.kl_coef > 0), in the loss or in the reward."""
    clock = [time.perf_counter()]

    def lap() -> float:  # seconds since the last lap: this rank's wall time of each phase
        clock.append(time.perf_counter())
        return clock[-1] - clock[-2]

    plan = plan_step(batch, group_size, config, routing, version, rank, world)
    plan_seconds = lap()
    stats = StepStats()
    old = recompute_old(model, plan, routing, config, stats, compute)
    old_seconds = lap()
    reference_seconds = 0.0
    if config.loss.kl_coef > 0:
        if reference is None:
            raise ValueError("loss.kl_coef > 0 needs the reference model")
        old.reference = reference_logprobs(reference, plan, compute)
        if config.loss.kl_in == "reward":
            kl_in_reward(plan, old.reference, group_size, config, stats, world)
        reference_seconds = lap()
    check_inputs(plan, old, world, compute.device)
    snapshot = Snapshot(model, optimizer) if len(plan.rows_of) > 1 else None
    for i, rows in enumerate(plan.rows_of):
        try:
            update(model, optimizer, routing, plan, old, rows, config, stats, world, compute, first=i == 0)
        except NonFiniteStep:
            if snapshot is not None and i > 0:  # the step's earlier updates are undone with it
                snapshot.restore(optimizer)
            raise
    update_seconds = lap()
    reduce_stats(stats, world)
    metrics = stats.result()
    mask = batch.loss_mask
    if batch.teacher_logprobs is not None and mask.any():  # log π_teacher − log μ: the reverse KL's sample, negated
        metrics["teacher_gap"] = float((batch.teacher_logprobs - batch.inference_logprobs)[mask].mean())
    scored = batch.scored if batch.scored is not None else torch.ones(batch.size, dtype=torch.bool)
    metrics.update(
        reward_mean=float(batch.rewards[scored].mean()) if scored.any() else 0.0,  # the rewards that scored
        reward_excluded=float((~scored).sum()),  # rollouts whose reward failed: off the loss
        staleness_mean=float(plan.staleness[mask].mean()) if mask.any() else 0.0,
        staleness_peak=float(plan.staleness[mask].max()) if mask.any() else 0.0,
        tokens=float(mask.sum()),
        loss_seconds=metrics["loss_seconds"] / world,
    )
    for b in plan.buckets:
        metrics[f"staleness_tokens_s{b}"] = float((plan.staleness[mask] == b).sum())
    if config.exact:  # every token checked bit for bit: each IS weight is exp(0), the correction the identity
        metrics["exact_tokens"] = metrics.get("exact_tokens", 0.0)
        metrics["is_identity"] = float(metrics["exact_tokens"] == metrics["tokens"])
    metrics.update(  # where the step's time went (docs/operate/metrics.md)
        plan_seconds=plan_seconds,
        old_logprobs_seconds=old_seconds,
        **({"reference_seconds": reference_seconds} if config.loss.kl_coef > 0 else {}),
        update_seconds=update_seconds,
        diagnostics_seconds=lap(),
    )
    return metrics
