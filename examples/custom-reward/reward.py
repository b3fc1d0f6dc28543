"""A reward of your own: partial credit for the arith demo, weighed by how hard the problem is.

The demo's own reward, `exact_match`, gives 1 for the exact answer and 0 for anything else. This
one also gives partial credit for each of the answer's characters the completion has in the right
place, so "a digit off" scores better than nonsense, and more of it on a harder problem: besides
(completion, answer) it takes two keyword arguments of the problem's dataset row, the `prompt`
("07+35=": its operands' width) and the row's `carries` column (how many carries the sum makes). The
recipe names it `reward:score` (module `reward`, function `score`); the module must be importable by
the replicas, hence `PYTHONPATH=examples/custom-reward`.
"""


def score(completion: str, answer: str, *, prompt: str = "", carries: int = 0) -> float:
    """1.0 for the exact answer; else the share of the answer's characters in place × 0.5 × (1 +
    carries) / (1 + the operands' width): up to 0.5 on a problem that carries at every digit, a third
    of that on a 2-digit problem with no carry. Without a prompt (the dry call before the run): 0.5 ×
    the share."""
    got, want = completion.strip(), answer.strip()
    if got == want:
        return 1.0
    if not want:
        return 0.0
    in_place = sum(a == b for a, b in zip(got, want, strict=False))
    share = in_place / max(len(got), len(want))
    width = len(prompt.split("+")[0])
    return 0.5 * share * ((1 + carries) / (1 + width) if width else 1.0)
