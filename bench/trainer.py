"""Trainer benchmark on the tiny MoE (fp32): the share of a global step spent in the loss and
correction math (shared.core.loss.policy_loss), and the routing replay overhead of a training
forward + backward (R3 replay vs free routing), measured side by side in one run; and where the
trainer's cycle goes on the demo (`demo_step_costs`: each phase's share, from a short real run's
metrics.jsonl). Prints one JSON object."""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

GROUPS = 16
GROUP = 8
ROUNDS = 5


def rollouts(model_dir, groups: int = GROUPS, max_new_tokens: int = 8):
    from shared.engines import Sampling, make_engine
    from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts
    from shared.rollouts.record import RolloutTimings
    from shared.rollouts.samples import rollouts_from_samples
    from shared.rpc.steadyrl.v1 import common_pb2

    engine = make_engine("torch", str(model_dir), "bfloat16")
    examples = TinySpec().task(seed=2).split("train", groups)
    prompts = encode_prompts(char_tokenizer(), [e.prompt for e in examples])
    samples = engine.generate(
        [p for p in prompts for _ in range(GROUP)],
        Sampling(temperature=1.0, max_new_tokens=max_new_tokens, seed=1),
        return_trace=True,
    )
    out = []
    for g, prompt in enumerate(prompts):
        task = common_pb2.PromptTask(task_id=f"t{g}", prompt_token_ids=prompt)
        mine = samples[g * GROUP : (g + 1) * GROUP]
        out.extend(
            rollouts_from_samples(task, mine, [float(i % 2) for i in range(GROUP)], "b", "torch", RolloutTimings())
        )
    return out


def wider_model(model_dir):
    """A random-init Qwen3-MoE 8× wider than the tiny one (same vocab, layers, experts, top-k),
    so the step's forward/backward weigh what they do in a real model relative to the loss."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.hidden_size = 512
    config.moe_intermediate_size = 256
    config.intermediate_size = 512
    config.num_attention_heads = 8
    config.num_key_value_heads = 2  # layers stay 2: the traces fit
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float().train()


def measure(model, batch) -> dict:
    from services.trainer.forward import sequence_logprobs
    from services.trainer.global_step import StepConfig, train_step
    from shared.models.routing import RoutingController

    routing = RoutingController(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    shares = []
    steps = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        metrics = train_step(model, optimizer, routing, batch, GROUP, StepConfig(mini_batches=2, replay="r2"), 0)
        seconds = time.perf_counter() - started
        shares.append(metrics["loss_seconds"] / seconds)
        steps.append(seconds)

    def forward_backward(replay: bool) -> float:
        started = time.perf_counter()
        forward = sequence_logprobs(
            model,
            batch,
            routing,
            replay=batch.trace if replay else None,
            replay_mask=batch.trace_mask if replay else None,
        )
        (forward.logprobs * batch.loss_mask).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    forward_backward(False)
    free = []
    replayed = []
    for _ in range(ROUNDS * 2):  # alternate, so drift hits both alike
        free.append(forward_backward(False))
        replayed.append(forward_backward(True))
    free_s = statistics.median(free)
    replay_s = statistics.median(replayed)
    routing.close()
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_seconds_median": round(statistics.median(steps), 4),
        "loss_math_share_of_step": round(statistics.median(shares), 4),
        "forward_backward_seconds_free": round(free_s, 4),
        "forward_backward_seconds_replay": round(replay_s, 4),
        "replay_overhead": round(replay_s / free_s - 1, 4),
    }


def shared_prefix(model_dir, rounds: int = 15) -> dict:
    """The demo's step (32 prompts × 8 samples, 6 new tokens, N = 1, one thread) with each distinct prompt prefix
    computed once against whole rows (services.trainer.shared_prefix), interleaved round by round:
    median seconds per step of each and their ratio, with its spread over the pairs."""
    from services.trainer.batch import collate
    from services.trainer.forward import Compute
    from services.trainer.global_step import StepConfig, train_step
    from shared.models import load_causal_lm
    from shared.models.routing import RoutingController

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the demo's trainer.compute.torch_threads
    batch = collate(rollouts(model_dir, groups=32, max_new_tokens=6))
    sides = {}
    for shared in (False, True):
        model = load_causal_lm(model_dir, "float32").train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        sides[shared] = (model, RoutingController(model), optimizer, Compute(shared_prefix=shared), [])
    for round_ in range(rounds + 2):  # two untimed rounds first
        for shared in (False, True) if round_ % 2 == 0 else (True, False):
            model, routing, optimizer, compute, times = sides[shared]
            started = time.perf_counter()
            train_step(model, optimizer, routing, batch, GROUP, StepConfig(), 0, compute=compute)
            if round_ >= 2:
                times.append(time.perf_counter() - started)
    torch.set_num_threads(threads)
    whole, shared = sides[False][4], sides[True][4]
    pairs = sorted(round(s / w, 3) for w, s in zip(whole, shared, strict=True))
    return {
        "rows": batch.size,
        "width": int(batch.input_ids.shape[1]),
        "step_seconds_whole_rows": round(statistics.median(whole), 4),
        "step_seconds_shared_prefix": round(statistics.median(shared), 4),
        "shared_over_whole": round(statistics.median(shared) / statistics.median(whole), 3),
        "shared_over_whole_spread": [pairs[0], pairs[-1]],
        "pairs": len(pairs),
    }


DEMO_STEPS = 80
CONTROL_TARGET_MS = 20  # the control threads' CPU per demo step, all together (bench.thread_cpu.CONTROL)
# a step line's phases: inside the step (the trainer's thread), then what follows its line (the
# checkpoint and the publish, reported on the next line) and the wait for rollouts before it
PHASES = (
    "collate_seconds",
    "plan_seconds",
    "old_logprobs_seconds",
    "update_seconds",
    "diagnostics_seconds",
    "checkpoint_seconds",
    "publish_seconds",
    "trainer_wait_seconds",
)


def demo_step_costs(steps: int = DEMO_STEPS) -> dict:
    """The demo recipe (configs/tiny-arith.toml) run for `steps` steps without evals: each phase's
    mean seconds and its share of the mean cycle (step line to step line), steps 21 on (past the
    start); `update` includes the loss math (`loss_seconds`, also given), `other` is the cycle
    left (reading and decoding rollouts, bookkeeping, the step line). With it, every service
    thread's CPU milliseconds per step over steps 20 to `steps` - 5 (`bench.thread_cpu`): the
    control threads' total against CONTROL_TARGET_MS."""
    import tempfile
    from pathlib import Path

    from bench.thread_cpu import demo_threads
    from shared.runtime.jsonl import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        try:
            threads = demo_threads(
                "configs/tiny-arith.toml", [f"run.steps={steps}", "orchestrator.evals.every=0"], 20, steps - 5, out
            )
        except RuntimeError as exc:
            return {"error": str(exc)}
        lines = [m for m in read_jsonl(out / "metrics.jsonl") if "step_seconds" in m]
    cycles = [(b["unix_ms"] - a["unix_ms"]) / 1000 for a, b in zip(lines, lines[1:], strict=False)][20:]
    later = lines[21:]  # the lines whose cycle is measured (each carries the previous step's publish)
    cycle = statistics.mean(cycles)
    means = {name: statistics.mean(m.get(name, 0.0) for m in later) for name in (*PHASES, "loss_seconds")}
    result = {
        "steps": steps,
        "steps_measured": len(cycles),
        "cycle_seconds": round(cycle, 4),
        "seconds": {k.removesuffix("_seconds"): round(v, 5) for k, v in means.items()},
        "share_of_cycle": {
            k.removesuffix("_seconds"): round(v / cycle, 4) for k, v in means.items() if k != "loss_seconds"
        },
    }
    result["share_of_cycle"]["other"] = round(1 - sum(result["share_of_cycle"].values()), 4)
    result["replica_idle_share"] = round(statistics.mean(m.get("replica_idle_share", 0.0) for m in later), 4)
    result["threads"] = threads
    result["control_target_ms"] = CONTROL_TARGET_MS
    return result


def main() -> dict:
    from services.trainer.batch import collate
    from shared.kit.tiny import init_tiny_model
    from shared.models import load_causal_lm

    model_dir = init_tiny_model()
    batch = collate(rollouts(model_dir))
    return {
        "benchmark": "trainer",
        "rollouts": batch.size,
        "tokens": int(batch.loss_mask.sum()),
        "sequence_tokens": int(batch.attention_mask.sum()),
        "mini_batches": 2,
        "replay": "r2",
        "threads": torch.get_num_threads(),
        "tiny": measure(load_causal_lm(model_dir, "float32").train(), batch),
        "wider": measure(wider_model(model_dir), batch),
        "shared_prefix": shared_prefix(model_dir),
        "demo_step_costs": demo_step_costs(),
        "target_loss_math_share": 0.03,
        "target_replay_overhead": 0.10,
    }


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.exit(0)
