"""One request's failure stays its own: a sequence whose sampling, callback or
forward fails fails alone; every other sequence in the batch finishes with the logprobs of a
fresh forward. Requests outside the model's vocabulary or sane sampling never enter the batch."""

import threading

import pytest
import torch

from shared.engines import Sampling, make_engine
from shared.engines.sequences import Seq, SeqFuture
from shared.models import load_causal_lm
from tests.integration.test_inference import fresh_forward, prompts_of

SAMPLING = Sampling(temperature=1.0, max_new_tokens=10, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = make_engine("torch", str(tiny_model_dir), "float32", max_num_seqs=16)
    yield engine
    engine.close()


def check_exact(model_dir, prompts, samples) -> float:
    reference = load_causal_lm(model_dir, "float32")
    worst = 0.0
    for prompt, sample in zip(prompts, samples, strict=True):
        logp, _ = fresh_forward(reference, prompt, sample.token_ids)
        worst = max(worst, float((logp - torch.tensor(sample.logprobs)).abs().max()))
    return worst


def test_a_failing_callback_fails_its_sequence_alone(engine, tiny_model_dir):
    prompts = prompts_of(8)
    calls = []

    def explode(token, logprob, version):
        calls.append(token)
        if len(calls) == 3:
            raise RuntimeError("the caller's callback broke")

    futures = [engine.start(p, SAMPLING, on_token=explode if i == 5 else None, index=i) for i, p in enumerate(prompts)]
    with pytest.raises(RuntimeError, match="callback broke"):
        futures[5].result(60)
    others = [f.result(60) for i, f in enumerate(futures) if i != 5]
    assert [len(s.token_ids) for s in others] == [10] * 7
    assert check_exact(tiny_model_dir, [p for i, p in enumerate(prompts) if i != 5], others) <= 1e-4
    assert engine.error is None and engine.running == 0


def test_a_forward_that_fails_for_one_sequence_fails_it_alone(engine, tiny_model_dir):
    """A prompt the model cannot embed (a token id past the vocabulary, put straight into the
    engine's queue as a bug or a bypassed check would): the batch's prefill fails, each sequence
    is run alone, only that one fails."""
    prompts = prompts_of(6, seed=1)
    gate = threading.Event()
    first = [engine.start(p, SAMPLING, on_token=lambda *a: gate.wait(10), index=i) for i, p in enumerate(prompts[:3])]
    poisoned = Seq([1, engine.vocab_size + 7, 3], SAMPLING, 0, False, None, SeqFuture())
    with engine._wake:  # the running batch (3 sequences) is held mid-step by its callback
        engine._waiting.append(poisoned)
    later = [engine.start(p, SAMPLING, index=3 + i) for i, p in enumerate(prompts[3:])]
    gate.set()
    with pytest.raises(IndexError):
        poisoned.future.result(60)
    samples = [f.result(60) for f in first + later]
    assert [len(s.token_ids) for s in samples] == [10] * 6
    assert check_exact(tiny_model_dir, prompts, samples) <= 1e-4
    assert engine.error is None and engine.running == 0


@pytest.mark.parametrize(
    "prompt, sampling, message",
    [
        ([1, 2, 10**9], SAMPLING, "outside the vocabulary"),
        ([1, 2, -1], SAMPLING, "outside the vocabulary"),
        ([1, 2, 3], Sampling(max_new_tokens=4, stop_token_ids=(10**9,)), "stop token id"),
    ],
)
def test_a_request_outside_the_vocabulary_is_refused_before_it_enters(engine, prompt, sampling, message):
    running = engine.start(prompts_of(1)[0], SAMPLING)
    with pytest.raises(ValueError, match=message):
        engine.start(prompt, sampling)
    assert len(running.result(60).token_ids) == 10
