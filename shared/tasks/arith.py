"""Synthetic multi-digit addition with an exact-match reward, for the tiny CPU model.

Prompt "417+86=", answer "503", and one column for a reward that asks for it: `carries`, how many
carries the sum makes (2 here), a measure of its difficulty. Splits are generated from a seed; train
and eval never share a problem.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from shared.tasks.registry import Example, register_reward


@dataclass(frozen=True)
class ArithTask:
    """a + b with operands of 1..`digits` digits."""

    digits: int = 3
    seed: int = 0
    fixed_width: bool = False
    """Zero-pad operands to `digits` and the sum to `digits`+1, so every digit has a fixed position."""
    reverse: bool = False
    """Write the sum least-significant digit first ("417+86=" → "305"): the order a small
    model can compute carries in, one digit per token."""
    name: str = "arith"
    reward_name: str = "exact_match"

    def _problem(self, rng: random.Random) -> tuple[int, int]:
        high = 10**self.digits
        return rng.randrange(high), rng.randrange(high)

    def example(self, a: int, b: int) -> Example:
        width = self.digits if self.fixed_width else 0
        answer = f"{a + b:0{width + 1 if width else 0}d}" if width else str(a + b)
        answer = answer[::-1] if self.reverse else answer
        return Example(prompt=f"{a:0{width}d}+{b:0{width}d}=", answer=answer, columns={"carries": carries(a, b)})

    @property
    def num_problems(self) -> int:
        return (10**self.digits) ** 2

    def max_split_size(self, name: str) -> int:
        """Most problems a split can hold (about 4/5 of all problems are train, 1/5 eval;
        the bound leaves slack so drawing them stays fast)."""
        return self.num_problems * (7 if name == "train" else 3) // 20

    def split(self, name: str, size: int) -> list[Example]:
        """`size` distinct problems of split "train" or "eval" (disjoint, deterministic)."""
        if name not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {name!r}")
        if size > self.max_split_size(name):
            raise ValueError(
                f"{size} {name} problems asked; {self.digits}-digit addition allows {self.max_split_size(name)}"
            )
        rng = random.Random(f"{self.name}-{self.digits}-{self.seed}-{name}")
        out: dict[tuple[int, int], Example] = {}
        while len(out) < size:
            a, b = self._problem(rng)
            # a hash of the problem decides its split: disjoint for any sizes, and unrelated to
            # the digits (a linear rule would put every sum ≡ 0 mod 5 in one split)
            if _is_eval(a, b, self.seed) != (name == "eval"):
                continue
            out.setdefault((a, b), self.example(a, b))
        return list(out.values())


def carries(a: int, b: int) -> int:
    """How many carries written addition of a and b makes, digit by digit."""
    count = carry = 0
    while a or b:
        carry = int(a % 10 + b % 10 + carry >= 10)
        count += carry
        a, b = a // 10, b // 10
    return count


def _is_eval(a: int, b: int, seed: int) -> bool:
    digest = hashlib.blake2b(f"{seed}:{a}+{b}".encode(), digest_size=2).digest()
    return int.from_bytes(digest, "little") % 5 == 0


@register_reward("exact_match", inline=True)
def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped of whitespace, equals the answer; else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0
