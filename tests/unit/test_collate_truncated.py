"""`trainer.mask_truncated`: a rollout that ran out of tokens keeps no token in the loss mask; the
others keep theirs, and every reward stays in the batch (the advantages still count it)."""

import numpy as np
import torch

from services.trainer.batch import collate
from shared.rollouts.record import Rollout


def rollout(index: int, completion: list[int], finish: str, reward: float) -> Rollout:
    return Rollout(
        rollout_id=f"g:{index}",
        group_id="g",
        prompt_token_ids=np.array([5, 6], dtype=np.int32),
        completion_token_ids=np.array(completion, dtype=np.int32),
        inference_logprobs=np.full(len(completion), -0.5, dtype=np.float32),
        policy_versions=np.zeros(len(completion), dtype=np.uint64),
        reward=reward,
        sample_index=index,
        group_size=2,
        finish_reason=finish,
    )


def test_truncated_rollouts_leave_the_loss_mask_only_when_asked():
    rollouts = [rollout(0, [7, 8, 1], "stop", 1.0), rollout(1, [7, 8, 9], "length", 0.0)]
    kept = collate(rollouts)
    masked = collate(rollouts, mask_truncated=True)
    assert kept.loss_mask.tolist() == [[False, True, True, True], [False, True, True, True]]
    assert masked.loss_mask.tolist() == [[False, True, True, True], [False, False, False, False]]
    assert torch.equal(masked.rewards, torch.tensor([1.0, 0.0]))
    assert torch.equal(masked.input_ids, kept.input_ids)
