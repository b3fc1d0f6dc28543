"""On-policy distillation: the per-token advantage log π_teacher − log μ (mixed with the task's by a
weight), and through MiniRL's Eq. 7 the loss and gradient equal the math by hand on 3 tokens; the
teacher reply check of the replicas."""

import math

import pytest
import torch

from services.inference.teacher import reply_problem
from shared.core.distillation import distillation_advantages, top_k_kl
from shared.core.loss import LossConfig, policy_loss
from shared.rpc.steadyrl.v1 import inference_pb2 as pb

LN2 = math.log(2)
TEACHER = torch.log(torch.tensor([[0.5, 0.25, 0.8]]))
BEHAVIOUR = torch.log(torch.tensor([[0.25, 0.25, 0.4]]))  # μ: the sampler's logprobs


def test_the_advantage_is_the_teacher_s_log_ratio_by_hand():
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert distillation_advantages(TEACHER, BEHAVIOUR, mask, 1.0)[0].tolist() == pytest.approx([LN2, 0, LN2])
    # a token off the mask (an environment's) carries none; the task's Â joins the valid tokens by its weight
    mask = torch.tensor([[True, True, False]])
    mixed = distillation_advantages(TEACHER, BEHAVIOUR, mask, 0.5, torch.tensor([2.0]), reward_weight=0.25)
    assert mixed[0].tolist() == pytest.approx([0.5 * LN2 + 0.5, 0.5, 0.0])
    # a non-finite teacher logprob gives no advantage rather than a NaN
    broken = distillation_advantages(torch.tensor([[-math.inf, -1.0, 0.0]]), BEHAVIOUR, torch.ones(1, 3), 1.0)
    assert broken[0].tolist() == pytest.approx([0.0, -1.0 - math.log(0.25), -math.log(0.4)])
    # max_gap bounds each log-ratio both ways: a token the teacher all but rules out, one it prefers
    ruled_out = torch.log(torch.tensor([[1e-13, 0.9, 0.5]]))
    clamped = distillation_advantages(ruled_out, BEHAVIOUR, torch.ones(1, 3), 2.0, max_gap=0.5)
    assert clamped[0].tolist() == pytest.approx([-1.0, 1.0, 2 * math.log(0.5 / 0.4)])
    wide = distillation_advantages(ruled_out, BEHAVIOUR, torch.ones(1, 3), 1.0, max_gap=100.0)
    assert wide[0, 0].item() == pytest.approx(math.log(1e-13 / 0.25), rel=1e-5)  # ≈ −28.6 within a wide bound
    default = distillation_advantages(ruled_out, BEHAVIOUR, torch.ones(1, 3), 1.0)
    assert default[0, 0].item() == -10.0  # the default bound is finite
    for gap in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_gap must be finite and > 0"):
            distillation_advantages(ruled_out, BEHAVIOUR, torch.ones(1, 3), 1.0, max_gap=gap)


def test_through_minirl_the_loss_and_gradient_equal_the_math_by_hand():
    """π_θ = μ (on policy): w_t = 1, no clip, so loss = −Σ_t A_t log π_θ(y_t) / 3 and
    ∂loss/∂log π_θ(y_t) = −A_t / 3 with A = [ln 2, 0, ln 2]."""
    logprobs = BEHAVIOUR.clone().requires_grad_(True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    advantages = distillation_advantages(TEACHER, BEHAVIOUR, mask, 1.0)
    loss, _ = policy_loss(logprobs, None, BEHAVIOUR, advantages, mask, LossConfig())
    loss.backward()
    expected = -(LN2 * math.log(0.25) + 0 + LN2 * math.log(0.4)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert logprobs.grad[0].tolist() == pytest.approx([-LN2 / 3, 0.0, -LN2 / 3], abs=1e-6)


def test_a_teacher_reply_is_checked_before_it_rides_on_a_rollout():
    """Teacher replicas are not trusted: every logprob, as the float32 the loss holds, must be
    finite and within [-1e4, 0] — a reply of -3e38 (finite in float64 and float32) or -1e39
    (inf in float32) is a failed attempt, never a signal."""
    good = pb.ScoreReply(sequences=[pb.TokenLogprobs(logprobs=[-0.1, -2.0]), pb.TokenLogprobs(logprobs=[-1.0])])
    assert reply_problem(good, [2, 1]) == ""
    assert "1 sequences scored, 2 sent" in reply_problem(pb.ScoreReply(sequences=good.sequences[:1]), [2, 1])
    assert "1 logprobs for 2" in reply_problem(pb.ScoreReply(sequences=[good.sequences[1], good.sequences[1]]), [2, 1])
    for value in (math.nan, 0.5, -3e38, -1e39, -math.inf, -1.0001e4):
        bad = pb.ScoreReply(sequences=[pb.TokenLogprobs(logprobs=[value, -1.0]), good.sequences[1]])
        assert reply_problem(bad, [2, 1]).startswith("logprob_range: sequence 0"), value
    edge = pb.ScoreReply(sequences=[pb.TokenLogprobs(logprobs=[-1e4, 0.0]), good.sequences[1]])
    assert reply_problem(edge, [2, 1]) == ""


def test_the_top_k_kl_equals_the_math_by_hand_and_its_gradient_does_not_fade():
    """Teacher p_T = (0.6, 0.3) on its top 2 of 3 tokens (rest 0.1); π_θ = (0.01, 0.98, 0.01): the
    KL over (top 2, rest) is Σ p_T log(p_T/π) by hand, and ∂KL/∂logit_v = π(v) − p_T(v) on each
    token, large where π is confidently wrong (where log π_teacher − log μ on the sampled token
    has a gradient of 1 − 0.98)."""
    logits = torch.log(torch.tensor([[[0.01, 0.98, 0.01]]])).requires_grad_(True)
    policy = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor([[[0, 1]]])
    teacher = torch.log(torch.tensor([[[0.6, 0.3]]]))
    kl = top_k_kl(policy.gather(-1, ids), teacher)
    expected = 0.6 * math.log(0.6 / 0.01) + 0.3 * math.log(0.3 / 0.98) + 0.1 * math.log(0.1 / 0.01)
    assert kl.shape == (1, 1) and kl.item() == pytest.approx(expected, rel=1e-5)
    kl.sum().backward()
    # token 2 is the teacher's "rest": its target share is 0.1
    assert logits.grad[0, 0].tolist() == pytest.approx([0.01 - 0.6, 0.98 - 0.3, 0.01 - 0.1], abs=1e-5)
    # equal distributions on the top-k and the rest: 0, whatever is outside the top-k
    same = torch.log(torch.tensor([[[0.6, 0.3]]]))
    assert top_k_kl(same, teacher).item() == pytest.approx(0.0, abs=1e-6)


def test_the_trainer_adds_the_top_k_kl_under_the_objective_s_normaliser():
    """teacher_kl_loss on 2 valid tokens of 3 (the third off the mask): coef · Σ KL / 2."""
    from services.trainer.batch import TrainBatch
    from services.trainer.forward import Forward
    from services.trainer.global_step import StepConfig, teacher_kl_loss
    from shared.core.stats import StepStats

    policy = torch.log(torch.tensor([[[0.5, 0.25], [0.1, 0.8], [0.3, 0.3]]]))
    teacher = torch.log(torch.tensor([[[0.25, 0.5], [0.1, 0.8], [0.9, 0.05]]]))
    mask = torch.tensor([[True, True, False]])
    batch = TrainBatch(
        *(torch.zeros(1, 4, dtype=torch.long),) * 2,
        mask,
        torch.zeros(1, 3),
        torch.zeros(1, 3, dtype=torch.long),
        torch.zeros(1),
        None,
        None,
        ["r"],
        teacher_top_ids=torch.zeros(1, 3, 2, dtype=torch.long),
        teacher_top_logprobs=teacher,
    )
    forward = Forward(torch.zeros(1, 3), torch.zeros(1, 3), None, policy)
    stats = StepStats()
    loss = teacher_kl_loss(forward, batch, StepConfig(distill_top_k_coef=0.5), stats, 2, 1)
    first = 0.25 * math.log(0.25 / 0.5) + 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.25)
    assert loss.item() == pytest.approx(0.5 * (first + 0.0) / 2, rel=1e-5)
    assert stats.result()["teacher_kl"] == pytest.approx(first / 2, rel=1e-5)


def test_a_teacher_reply_s_top_k_is_checked_too():
    good = pb.ScoreReply(
        sequences=[
            pb.TokenLogprobs(logprobs=[-0.1, -2.0], top_token_ids=[3, 4, 5, 6], top_logprobs=[-0.1, -3, -0.2, -2]),
        ]
    )
    assert reply_problem(good, [2], top_k=2) == ""
    assert reply_problem(good, [2], top_k=2, vocab_size=7) == ""
    assert "4 ids, 4 logprobs for 2 tokens × k 3" in reply_problem(good, [2], top_k=3)
    assert "0 ids, 0 logprobs for 2 tokens × k 2" in reply_problem(
        pb.ScoreReply(sequences=[pb.TokenLogprobs(logprobs=[-0.1, -2.0])]), [2], top_k=2
    )
    for ids, logprobs, problem in (
        ([3, -4, 5, 6], [-0.1, -3, -0.2, -2], "top_k_ids: sequence 0: top-k token ids span [-4, 6]"),
        ([3, 4, 5, 7], [-0.1, -3, -0.2, -2], "top_k_ids: sequence 0: top-k token ids span [3, 7], vocabulary 7"),
        ([3, 3, 5, 6], [-0.1, -3, -0.2, -2], "top_k_ids: sequence 0: a top-k row names the same token twice"),
        ([3, 4, 5, 6], [-0.1, math.inf, -0.2, -2], "top_k_range: sequence 0"),
        ([3, 4, 5, 6], [-0.1, -3e38, -0.2, -2], "top_k_range: sequence 0"),
        ([3, 4, 5, 6], [-0.1, -0.1, -0.2, -2], "top_k_sum: sequence 0"),  # 0.90 + 0.90: more than 1
        ([3, 4, 5, 6], [0.0, 0.0, -0.2, -2], "top_k_sum: sequence 0"),
    ):
        bad = pb.ScoreReply(
            sequences=[pb.TokenLogprobs(logprobs=[-0.1, -2.0], top_token_ids=ids, top_logprobs=logprobs)]
        )
        assert reply_problem(bad, [2], top_k=2, vocab_size=7).startswith(problem), (ids, logprobs)
