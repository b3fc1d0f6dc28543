"""A reward of your own: partial credit for the arith demo.

The demo's own reward, `exact_match`, gives 1 for the exact answer and 0 for anything else. This
one also gives half a point, shared out over the answer's characters, for each character the
completion has in the right place, so "a digit off" scores better than nonsense. The recipe names
it `reward:score` (module `reward`, function `score`); the module must be importable by the
replicas, hence `PYTHONPATH=examples/custom-reward`.
"""


def score(completion: str, answer: str) -> float:
    """1.0 for the exact answer; else 0.5 × the share of the answer's characters in place."""
    got, want = completion.strip(), answer.strip()
    if got == want:
        return 1.0
    if not want:
        return 0.0
    in_place = sum(a == b for a, b in zip(got, want, strict=False))
    return 0.5 * in_place / max(len(got), len(want))
