"""How far the tiny model's routing and logprobs move between fp32 and a lower precision: the
training–inference mismatch the CPU demo trains through."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.kit.tiny import KitTask, TinySpec, sft_batch


@torch.no_grad()
def precision_routing_agreement(model_dir: str | Path, size: int = 256, low: str = "bfloat16") -> dict:
    """Routing agreement and logprob gap between fp32 and `low` precision on the eval split.

    The tiny model's training–inference mismatch on CPU: the same weights, the same tokens
    (prompt + reference answer), routed in two precisions.
    """
    from shared.core import routing_agreement
    from shared.models.loading import load_causal_lm, load_tokenizer
    from shared.models.routing import RoutingController

    info = json.loads((Path(model_dir) / "steadyrl_tiny.json").read_text())
    spec = TinySpec(**info["spec"])
    task = KitTask.of(info).task(spec, info["seed"])
    tokenizer = load_tokenizer(model_dir)
    ids, labels = sft_batch(tokenizer, task.split("eval", size))
    mask = ids != tokenizer.pad_token_id
    traces = []
    logprobs = []
    for dtype in ("float32", low):
        model = load_causal_lm(model_dir, dtype)
        controller = RoutingController(model)
        with controller.capture() as rec:
            logits = model(input_ids=ids).logits.float()
        traces.append(rec.trace(ids.shape))
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        logprobs.append(logp)
    answer = labels[:, 1:] != -100
    gap = (logprobs[0] - logprobs[1]).abs()[answer]
    return {
        "routing_agreement": float(routing_agreement(traces[0], traces[1], mask)),
        "answer_logprob_abs_diff_mean": float(gap.mean()),
        "answer_logprob_abs_diff_max": float(gap.max()),
        "tokens": int(mask.sum()),
        "low_precision": low,
    }
