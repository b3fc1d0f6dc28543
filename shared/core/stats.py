"""Whole-step statistics: token-weighted means and true maxima over every mini-batch and rank.

A step's diagnostics are not the mean of per-mini-batch means: `StepStats` keeps, per name, the
sum of values and the count of what was summed (tokens, sequences, optimizer steps), and the
maximum of max-type values. Mini-batches add into one `StepStats`; data-parallel ranks merge by
summing `sums`/`counts` and taking the maximum of `maxima` (`as_tensors` / `load_tensors` around an
all-reduce). Pure: tensors in, numbers out.
"""

from __future__ import annotations

import torch


class StepStats:
    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}
        self.totals: dict[str, torch.Tensor] = {}

    def add_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Contribute `values` where `mask` (same shape, bool) to the mean `name`."""
        values = values.detach().to(torch.float64)
        mask = mask.bool()
        total = torch.where(mask, values, torch.zeros_like(values)).sum()
        self._add(name, total, mask.sum().to(torch.float64))

    def add_sum(self, name: str, value: float | torch.Tensor, count: float = 1.0) -> None:
        """Contribute a pre-summed value to the mean `name`, and how many things it sums."""
        self._add(
            name,
            torch.as_tensor(value, dtype=torch.float64).detach().reshape(()),
            torch.tensor(float(count), dtype=torch.float64),
        )

    def add_total(self, name: str, value: float | torch.Tensor) -> None:
        """Contribute to the plain total `name` (reported as the sum, not a mean)."""
        value = torch.as_tensor(value, dtype=torch.float64).detach().reshape(()).cpu()
        self.totals[name] = self.totals.get(name, 0.0) + value

    def add_max(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        values = values.detach().to(torch.float64)
        if mask is not None:
            values = values[mask.bool()]
        top = values.max() if values.numel() else torch.tensor(float("-inf"), dtype=torch.float64)
        self.maxima[name] = torch.maximum(self.maxima.get(name, top), top)

    def _add(self, name: str, total: torch.Tensor, count: torch.Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + total.cpu()
        self.counts[name] = self.counts.get(name, 0.0) + count.cpu()

    def as_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sums, counts and totals; maxima) as two flat float64 tensors in name order: all-reduce the
        first with SUM and the second with MAX across ranks, then `load_tensors`."""
        names = sorted(self.sums)
        totals = sorted(self.totals)
        parts = [self.sums[n] for n in names] + [self.counts[n] for n in names] + [self.totals[n] for n in totals]
        additive = torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64)
        top = [self.maxima[n] for n in sorted(self.maxima)]
        return additive, torch.stack(top) if top else torch.zeros(0, dtype=torch.float64)

    def load_tensors(self, additive: torch.Tensor, maxima: torch.Tensor) -> None:
        names = sorted(self.sums)
        for i, name in enumerate(names):
            self.sums[name] = additive[i]
            self.counts[name] = additive[len(names) + i]
        for i, name in enumerate(sorted(self.totals)):
            self.totals[name] = additive[2 * len(names) + i]
        for i, name in enumerate(sorted(self.maxima)):
            self.maxima[name] = maxima[i]

    def result(self) -> dict[str, float]:
        """Means (sum / count, 0 where nothing was counted) and maxima (0 where nothing was seen)."""
        out = {n: float(self.sums[n] / self.counts[n]) if float(self.counts[n]) > 0 else 0.0 for n in self.sums}
        out.update({n: float(v) if torch.isfinite(v) else 0.0 for n, v in self.maxima.items()})
        out.update({n: float(v) for n, v in self.totals.items()})
        return out

    def count(self, name: str) -> float:
        return float(self.counts.get(name, 0.0))
