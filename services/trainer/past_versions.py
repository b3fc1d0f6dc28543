"""Exact mode's check of the tokens older versions sampled: the trainer keeps the weights of its last
`max_staleness` versions (on the CPU) and recomputes each stale token under the version that sampled
it, so every token of a step is compared bit for bit, not only those of the step's own version
(which `global_step.check_exact` compares in the step's own forward).

Details: docs/guides/exact.md"""

from __future__ import annotations

import torch

from services.trainer.batch import TrainBatch, token_budget_chunks
from services.trainer.forward import Compute, sequence_logprobs
from services.trainer.global_step import check_exact
from shared.core.stats import StepStats
from shared.models import batch_invariant, load_causal_lm


class PastVersions:
    """The weights of the versions a stale token can come from, and a second model to run them."""

    def __init__(self, model_path: str, keep: int, compute: Compute) -> None:
        self.model_path = model_path
        self.keep = keep
        self.compute = compute
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.shadow = None  # loaded on first use

    def remember(self, version: int, model: torch.nn.Module) -> None:
        """Keep `model`'s weights as `version`'s; forget those no later step can need."""
        if self.keep <= 0:
            return
        self.weights[version] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        for old in [v for v in self.weights if v <= version - self.keep]:
            del self.weights[old]

    @torch.no_grad()
    def check(self, batch: TrainBatch, version: int, stats: StepStats) -> None:
        """Every completion token of `batch` sampled by a version before `version`, recomputed under
        that version's weights and compared bit for bit (ExactMismatch naming the first that differs);
        a token whose version is no longer kept (after a restart) is counted as unchecked."""
        stale = batch.loss_mask & (batch.versions < version)
        for old in sorted({int(v) for v in batch.versions[stale].tolist()}):
            sampled_by = batch.loss_mask & (batch.versions == old)
            if old not in self.weights:
                stats.add_total("exact_unchecked_tokens", sampled_by.sum())
                continue
            model = self._shadow(old)
            rows = sampled_by.any(dim=-1).nonzero().flatten().tolist()
            mine = batch.select(rows)
            for chunk in token_budget_chunks(mine.lengths().tolist(), self.compute.micro_batch_tokens):
                part = mine.select(chunk).trimmed().to(self.compute.device)
                logprobs = sequence_logprobs(model, part, compute=self.compute).logprobs
                other = (part.versions != old).long()  # 0 where `old` sampled: the tokens compared
                check_exact(logprobs, part, other[:, : part.width - 1], old, stats)

    def _shadow(self, version: int) -> torch.nn.Module:
        if self.shadow is None:
            self.shadow = load_causal_lm(self.model_path, "float32").to(self.compute.device).eval()
            batch_invariant.prepare(self.shadow)
        self.shadow.load_state_dict(self.weights[version])
        return self.shadow
