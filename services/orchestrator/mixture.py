"""Which source each training task of a data mixture draws from.

Each cycle of CYCLE tasks gives every source an integer quota from the weights (largest remainder),
and smooth weighted round-robin spreads the quotas over the cycle, so any window of tasks holds
close to each source's share. Task i's source and its rank among that source's tasks are O(1)
lookups: any task can be made again from its number alone (recovery re-queues arbitrary ids)."""

from __future__ import annotations

import math
from collections.abc import Sequence

CYCLE = 1000  # tasks per cycle: a share is honoured to 1/CYCLE


def quotas(weights: Sequence[float], cycle: int = CYCLE) -> list[int]:
    """Tasks per cycle of each source: cycle × its share, rounded by largest remainder (ties: the
    earlier source), so the quotas sum to `cycle`."""
    total = sum(weights)
    exact = [cycle * w / total for w in weights]
    out = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(out)), key=lambda s: (out[s] - exact[s], s))
    for s in by_remainder[: cycle - sum(out)]:
        out[s] += 1
    return out


class MixturePlan:
    """The sources of one cycle in order, by smooth weighted round-robin over the quotas: each
    position adds every source's quota to its credit and picks the source with the most (ties: the
    earlier), which pays back `cycle`."""

    def __init__(self, weights: Sequence[float], cycle: int = CYCLE) -> None:
        self.cycle = cycle
        self.quotas = quotas(weights, cycle)
        self.order: list[int] = []  # the source of each position of a cycle
        self.rank: list[int] = []  # how many positions before it in the cycle drew from its source
        self.drawn_before: list[tuple[int, ...]] = [(0,) * len(self.quotas)]  # per position: tasks per source
        credit = [0] * len(self.quotas)
        for _ in range(cycle):
            credit = [c + q for c, q in zip(credit, self.quotas, strict=True)]
            source = max(range(len(credit)), key=credit.__getitem__)
            credit[source] -= cycle
            self.order.append(source)
            self.rank.append(self.drawn_before[-1][source])
            drawn = list(self.drawn_before[-1])
            drawn[source] += 1
            self.drawn_before.append(tuple(drawn))

    def task(self, i: int) -> tuple[int, int]:
        """(source, k) of task i: it is the k-th task (from 0) that draws from that source."""
        cycles, position = divmod(i, self.cycle)
        source = self.order[position]
        return source, cycles * self.quotas[source] + self.rank[position]

    def drawn(self, source: int, n: int) -> int:
        """How many of the first n tasks draw from `source`."""
        cycles, position = divmod(n, self.cycle)
        return cycles * self.quotas[source] + self.drawn_before[position][source]
