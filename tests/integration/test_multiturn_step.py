"""A multi-turn trajectory through the trainer's step, by hand: the completion interleaves three
model turns with two environment observations, and only the model's tokens enter Eq. 7's sum,
its normaliser and the diagnostics. The mask survives the wire; environment tokens' logprobs and
versions change nothing."""

import numpy as np
import pytest
import torch

from services.trainer.batch import collate
from services.trainer.global_step import StepConfig, train_step
from shared.core import LossConfig, policy_loss
from shared.models import load_causal_lm
from shared.rollouts.record import Rollout, RolloutError, decode_rollout, encode_rollout, validate_rollout

# turns of one trajectory: (tokens, who): model turn, observation, model turn, observation, model turn
TURNS = [([5, 6], 1), ([7, 8, 9], 0), ([10, 11], 1), ([12, 13], 0), ([14], 1)]
PROMPT = [3, 4, 5, 6]
GROUP = 2


def trajectory(index: int, reward: float, env_logprob: float = 0.0) -> Rollout:
    """One 3-turn trajectory: model tokens with plausible behaviour logprobs, environment tokens
    with `env_logprob` (what the engine never sampled)."""
    tokens = [t + index for turn, _ in TURNS for t in turn]
    mask = np.array([who for turn, who in TURNS for _ in turn], dtype=bool)
    rng = np.random.default_rng(index)
    logprobs = np.where(mask, -rng.uniform(0.5, 3.0, len(tokens)), env_logprob).astype(np.float32)
    return Rollout(
        rollout_id=f"g:{index}",
        group_id="g",
        prompt_token_ids=np.array(PROMPT, dtype=np.int32),
        completion_token_ids=np.array(tokens, dtype=np.int32),
        inference_logprobs=logprobs,
        policy_versions=np.zeros(len(tokens), dtype=np.uint64),
        reward=reward,
        sample_index=index,
        group_size=GROUP,
        task_id="g",
        loss_mask=mask,
    )


def test_the_mask_survives_the_wire_and_marks_only_the_model_s_tokens():
    rollout = trajectory(0, 1.0)
    again = decode_rollout(encode_rollout(rollout))
    assert again.loss_mask.tolist() == [True, True, False, False, False, True, True, False, False, True]
    single = Rollout(**{**vars(rollout), "loss_mask": None})  # a single-turn rollout: every token the model's
    assert decode_rollout(encode_rollout(single)).loss_mask is None and single.model_tokens.all()
    batch = collate([rollout])
    # position p predicts token p + 1: the completion starts at the prompt's last position (3)
    assert torch.nonzero(batch.loss_mask[0]).flatten().tolist() == [3, 4, 8, 9, 12]
    short = Rollout(**{**vars(rollout), "loss_mask": rollout.loss_mask[:-1]})
    with pytest.raises(RolloutError, match="loss_mask has 9 entries for 10 completion tokens"):
        validate_rollout(short)
    with pytest.raises(RolloutError, match="marks no model token"):
        validate_rollout(Rollout(**{**vars(rollout), "loss_mask": np.zeros(10, dtype=bool)}))


def stepped(model_dir, rollouts):
    model = load_causal_lm(model_dir, "float32").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    metrics = train_step(model, optimizer, None, collate(rollouts), GROUP, StepConfig(), version=0)
    return model, metrics


def test_a_three_turn_step_trains_the_model_s_tokens_alone_by_hand(tiny_model_dir):
    rollouts = [trajectory(0, 1.0), trajectory(1, 0.0)]
    model, metrics = stepped(tiny_model_dir, rollouts)
    # by hand: Eq. 7 over the 5 model tokens of each row, the group advantage per trajectory (±0.5)
    reference = load_causal_lm(tiny_model_dir, "float32").train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    batch = collate(rollouts)
    mask = torch.zeros_like(batch.loss_mask)
    mask[:, [3, 4, 8, 9, 12]] = True
    assert torch.equal(batch.loss_mask, mask)
    advantages = torch.tensor([0.5, -0.5])
    with torch.no_grad():
        logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
        old = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    current = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    loss, _ = policy_loss(current, old, batch.inference_logprobs, advantages, mask, LossConfig())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    optimizer.step()
    trained = model.state_dict()
    expected = reference.state_dict()
    assert max(float((trained[k] - v).abs().max()) for k, v in expected.items()) <= 1e-6
    # the diagnostics count model tokens alone: 10 of the 20 completion tokens
    assert metrics["tokens"] == 10
    kl = ((batch.inference_logprobs - old)[mask]).mean()  # k1 = E_μ[log μ − log π] over model tokens alone
    assert metrics["mismatch_kl_k1"] == pytest.approx(float(kl), rel=1e-5)


def test_environment_tokens_logprobs_change_nothing(tiny_model_dir):
    """The same trajectories with the environment's tokens carrying -30 instead of 0: the same update."""
    plain, plain_metrics = stepped(tiny_model_dir, [trajectory(0, 1.0), trajectory(1, 0.0)])
    odd, odd_metrics = stepped(tiny_model_dir, [trajectory(0, 1.0, -30.0), trajectory(1, 0.0, -30.0)])
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), odd.state_dict().values(), strict=True))
    timing = {k for k in plain_metrics if "seconds" in k or "per_s" in k}
    assert {k: v for k, v in plain_metrics.items() if k not in timing} == {
        k: v for k, v in odd_metrics.items() if k not in timing
    }
