"""A task with heavy-tailed answer lengths, for benchmarks and the stability work: multiplication
written as a worked trace of partial sums.

Prompt "7*23=", answer "23,46,69,92,115,138,161": the answer grows with the first operand, which
is drawn from a power law (P(a) ∝ a^-alpha), so most answers are a few tokens and a few run to
`max_answer_tokens` (one token per character with the tiny model's tokenizer).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from shared.tasks.registry import Example


@dataclass(frozen=True)
class MulTraceTask:
    max_answer_tokens: int = 96
    alpha: float = 1.1
    """Power-law exponent of the first operand: smaller is a heavier tail."""
    max_b: int = 99
    seed: int = 0
    name: str = "mul_trace"
    reward_name: str = "exact_match"

    def __post_init__(self) -> None:
        if self.max_answer_tokens < 8:
            raise ValueError(f"max_answer_tokens must be >= 8, got {self.max_answer_tokens}")
        if self.alpha <= 0 or self.max_b < 1:
            raise ValueError("alpha must be > 0 and max_b >= 1")

    def example(self, a: int, b: int) -> Example:
        return Example(prompt=f"{a}*{b}=", answer=",".join(str(b * i) for i in range(1, a + 1)))

    def _longest_a(self, b: int) -> int:
        """The largest first operand whose trace fits max_answer_tokens."""
        a = 0
        length = -1
        while True:
            step = len(str(b * (a + 1))) + 1
            if length + step > self.max_answer_tokens:
                return a
            a = a + 1
            length = length + step

    def _problem(self, rng: random.Random) -> tuple[int, int]:
        b = rng.randint(1, self.max_b)
        top = self._longest_a(b)
        weights = [k**-self.alpha for k in range(1, top + 1)]
        return rng.choices(range(1, top + 1), weights)[0], b

    def split(self, name: str, size: int) -> list[Example]:
        """`size` problems of split "train" or "eval" (disjoint; repeats allowed, the problem space
        being small at the short end, as real datasets repeat short problems in kind)."""
        if name not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {name!r}")
        rng = random.Random(f"{self.name}-{self.seed}-{name}")
        out: list[Example] = []
        while len(out) < size:
            a, b = self._problem(rng)
            if _is_eval(a, b, self.seed) == (name == "eval"):
                out.append(self.example(a, b))
        return out


def _is_eval(a: int, b: int, seed: int) -> bool:
    digest = hashlib.blake2b(f"{seed}:{a}*{b}".encode(), digest_size=2).digest()
    return int.from_bytes(digest, "little") % 5 == 0
