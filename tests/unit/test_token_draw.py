"""The torch engine's token draw (`shared.engines.sequences.sample_next`): inverse-CDF sampling
follows the processed distribution, never picks a token truncated away, and a seeded row draws
the same tokens whatever else is in the batch."""

import torch

from shared.engines.base import Sampling
from shared.engines.sequences import Seq, SeqFuture, sample_next

PROBS = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])


def _rows(n: int, sampling: Sampling, seed: int = 0) -> list[Seq]:
    rows = [Seq([1], sampling, seed, False, None, SeqFuture()) for _ in range(n)]
    for row in rows:
        if seed:
            row.generator = torch.Generator().manual_seed(seed)
    return rows


def test_frequencies_follow_the_distribution_and_logprobs_are_its_own():
    torch.manual_seed(0)
    sampling = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True)
    rows = _rows(40_000, sampling)
    sample_next(rows, PROBS.log().expand(len(rows), -1), 0, ())
    tokens = torch.tensor([r.tokens[0] for r in rows])
    freq = torch.bincount(tokens, minlength=5).double() / len(rows)
    assert freq[1] == 0  # zero probability: never drawn
    # 40,000 draws: a standard error of at most 0.0025 per token; 4 of them is the bound
    assert torch.allclose(freq, PROBS.double(), atol=0.01), freq
    for row in rows[:50]:
        assert abs(row.logprobs[0] - float(PROBS[row.tokens[0]].log())) < 1e-6


def test_top_k_truncation_is_never_sampled_through():
    torch.manual_seed(1)
    sampling = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True, top_k=2)
    rows = _rows(5_000, sampling)
    sample_next(rows, PROBS.log().expand(len(rows), -1), 0, ())
    assert {r.tokens[0] for r in rows} == {0, 2}
    share = sum(r.tokens[0] == 0 for r in rows) / len(rows)
    assert abs(share - 0.5 / 0.8) < 0.03


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    sampling = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True, seed=7)
    logits = torch.randn(9, 5)
    alone = _rows(1, sampling, seed=7)
    sample_next(alone, logits[4:5], 0, ())
    batch = _rows(9, sampling, seed=7)
    torch.manual_seed(123)
    sample_next(batch, logits, 0, ())
    assert batch[4].tokens == alone[0].tokens
    again = _rows(1, sampling, seed=7)
    for _ in range(3):
        sample_next(again, logits[4:5], 0, ())
    seq = _rows(1, sampling, seed=7)
    sample_next(seq, logits[4:5], 0, ())
    assert again[0].tokens[0] == seq[0].tokens[0]
