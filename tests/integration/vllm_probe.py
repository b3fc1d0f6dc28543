"""Runs the vllm engine in its own process (vLLM spawns workers: it needs a __main__ guard) and
prints what it sampled as JSON, before and after a weight update. Used by test_vllm_engine."""

import json
import sys


def main() -> None:
    import torch

    from shared.engines import Sampling, make_engine
    from shared.models import load_causal_lm

    model_dir, dtype, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    engine = make_engine("vllm", model_dir, dtype, max_model_len=64)
    out = {"capabilities": {"routing_trace": engine.capabilities.routing_trace, "notes": engine.capabilities.notes}}
    sampled = engine.generate(prompts, Sampling(temperature=1.0, max_new_tokens=10, seed=11))
    out["v0"] = [vars(s) for s in sampled]
    new = load_causal_lm(model_dir, "float32")
    with torch.no_grad():
        new.model.layers[1].mlp.gate.weight.mul_(-1.0)
        new.lm_head.weight.mul_(1.3)
    seconds = engine.update_weights(1, new.state_dict())
    out["swap_seconds"] = seconds
    out["v1_greedy"] = [vars(s) for s in engine.generate(prompts, Sampling(temperature=0, max_new_tokens=10))]
    out["v1"] = [vars(s) for s in engine.generate(prompts, Sampling(temperature=1.0, max_new_tokens=10, seed=3))]
    try:
        engine.generate(prompts, Sampling(), return_trace=True)
        out["trace_error"] = ""
    except ValueError as exc:
        out["trace_error"] = str(exc)
    engine.close()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
