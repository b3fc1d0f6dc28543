"""Runs the vllm engine in its own process (vLLM spawns workers: it needs a __main__ guard) and
prints what it sampled as JSON: before and after a weight update, across an update that lands in
flight, and across one that waits for the running request (between_requests). Used by
test_vllm_engine."""

import json
import sys
import threading


def version_model(model_dir: str, k: int):
    """Version k of the tiny model: the router's sign flipped k times, lm_head scaled by 1 + 0.3k."""
    import torch

    from shared.models import load_causal_lm

    model = load_causal_lm(model_dir, "float32")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.mul_((-1.0) ** k)
        model.lm_head.weight.mul_(1.0 + 0.3 * k)
    return model


def across_an_update(engine, prompt: list[int], version: int, model_dir: str, after: int = 4) -> dict:
    """A long request; version `version` is staged (from weight-sync's side, a thread) once
    `after` tokens are out. The version's weights are built before the request starts: built in
    the thread, on a loaded machine the request could finish first."""
    from shared.engines import Sampling

    seen = []
    staged = []
    weights = version_model(model_dir, version).state_dict()

    def on_token(token, logprob, v):
        seen.append(token)
        if len(seen) == after and not staged:
            staged.append(threading.Thread(target=engine.update_weights, args=(version, weights)))
            staged[0].start()

    sample = engine.start(
        prompt, Sampling(temperature=1.0, max_new_tokens=40, seed=9, ignore_eos=True), on_token=on_token
    ).result(300)
    staged[0].join(300)
    return vars(sample)


def one_failing(engine, prompts: list[list[int]]) -> dict:
    """Eight requests at once, one of them failing (its streaming callback raises after 3 tokens)
    and one refused at the door (a temperature that would overflow): the others finish."""
    from shared.engines import Sampling

    sampling = Sampling(temperature=1.0, max_new_tokens=10, seed=5, ignore_eos=True)
    calls = []

    def explode(token, logprob, version):
        calls.append(token)
        if len(calls) == 3:
            raise RuntimeError("the caller's callback broke")

    futures = [engine.start(p, sampling, on_token=explode if i == 2 else None, index=i) for i, p in enumerate(prompts)]
    try:
        engine.start(prompts[0], Sampling(temperature=1e-40))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    out = {"refused": refused, "lengths": [], "error": ""}
    for future in futures:
        try:
            out["lengths"].append(len(future.result(300).token_ids))
        except RuntimeError as exc:
            out["lengths"].append(-1)
            out["error"] = str(exc)
    out["engine_error"] = repr(engine.error) if engine.error else ""
    return out


def main() -> None:
    from shared.engines import Sampling, make_engine

    model_dir = sys.argv[1]
    dtype = sys.argv[2]
    prompts = json.loads(sys.argv[3])
    engine = make_engine("vllm", model_dir, dtype)  # the default 1024, past the tiny model's 64 positions
    out = {"capabilities": {"routing_trace": engine.capabilities.routing_trace, "notes": engine.capabilities.notes}}
    out["max_model_len"] = engine.max_model_len
    sampled = engine.generate(prompts, Sampling(temperature=1.0, max_new_tokens=10, seed=11))
    out["v0"] = [vars(s) for s in sampled]
    seconds = engine.update_weights(1, version_model(model_dir, 1).state_dict())
    out["swap_seconds"] = seconds
    out["last_update"] = engine.last_update
    out["v1_greedy"] = [vars(s) for s in engine.generate(prompts, Sampling(temperature=0, max_new_tokens=10))]
    out["v1"] = [vars(s) for s in engine.generate(prompts, Sampling(temperature=1.0, max_new_tokens=10, seed=3))]
    pairs = [(p, s["token_ids"]) for p, s in zip(prompts, out["v1"], strict=True)]
    out["v1_scored"] = [vars(s) for s in engine.score(pairs, top_k=5)]
    try:
        engine.score([(prompts[0], [engine.vocab_size])])
        out["score_refused"] = ""
    except ValueError as exc:
        out["score_refused"] = str(exc)
    out["in_flight"] = across_an_update(engine, prompts[0], 2, model_dir)
    engine.update_mode = "between_requests"
    out["between_requests"] = across_an_update(engine, prompts[1], 3, model_dir)
    out["after"] = vars(engine.generate(prompts[:1], Sampling(max_new_tokens=4))[0])
    out["first_token_at"] = engine.first_token_at
    out["one_failing"] = one_failing(engine, prompts)
    try:
        engine.generate(prompts, Sampling(), return_trace=True)
        out["trace_error"] = ""
    except ValueError as exc:
        out["trace_error"] = str(exc)
    from prometheus_client import REGISTRY

    out["vllm_metrics"] = {
        s.name: s.value
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name
        in (
            "vllm:kv_cache_usage_perc",
            "vllm:num_requests_waiting",
            "vllm:num_requests_running",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
        )
    }
    engine.close()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
