"""Plays multi-turn trajectories on the vllm engine in its own process (vLLM needs a __main__
guard) and prints them as JSON with vLLM's prefix-cache counters. Used by test_vllm_engine
(through vllm_lora_probe, which runs it first in its process)."""

import asyncio
import json
import sys


def probe(model_dir: str) -> dict:
    from prometheus_client import REGISTRY

    from shared.engines import Sampling, make_engine
    from shared.envs.trajectory import Budget, play
    from shared.models import load_tokenizer
    from tests.envs import Echo

    engine = make_engine("vllm", model_dir, "float32", max_model_len=64, block_size=32)  # CPU: multiples of 32
    tokenizer = load_tokenizer(model_dir)
    sampling = Sampling(temperature=1.0, max_new_tokens=4, seed=5)
    prompt = "12*34=" * 6  # 37 tokens with the template: one whole 32-token block the trajectories share

    async def group():
        return await asyncio.gather(
            *(
                play(
                    engine, tokenizer, Echo(), {"prompt": prompt}, sampling, Budget(max_turns=4, max_tokens=24), index=i
                )
                for i in range(4)
            )
        )

    played = asyncio.run(group())
    counters = {
        s.name: s.value
        for m in REGISTRY.collect()
        for s in m.samples
        if s.name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    }
    engine.close()
    return {
        "trajectories": [
            {
                "prompt": t.prompt_token_ids,
                "tokens": t.token_ids,
                "mask": t.loss_mask,
                "logprobs": t.logprobs,
                "turns": t.turns,
                "reward": t.reward,
            }
            for t in played
        ],
        "prefix_cache": counters,
    }


def main() -> None:
    print("RESULT " + json.dumps(probe(sys.argv[1])), flush=True)


if __name__ == "__main__":
    main()
