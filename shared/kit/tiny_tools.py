"""The tiny-model kit's multi-turn task: 2-digit multiplication with the `calc` tool (`shared.envs.calc`).

The tokenizer gets a chat template (`TOOL_TEMPLATE`); the cold start is SFT on traces rendered by the same code a
replica renders trajectories with, the loss on the model's turns alone, until the accuracy of sampled trajectories
reaches the target. A minority of the traces use the tool (`TOOL_SHARE`), so RL has the tool's use to learn.

Details: docs/internals/engines.md"""

from __future__ import annotations

import asyncio

import torch

from shared.envs.base import Message
from shared.envs.calc import Calculator, MulTask
from shared.envs.trajectory import render
from shared.kit.build_progress import BuildProgress

TOOL_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}:{{ m.content }}</s>"
    "{%- elif m.role == 'tool' -%}{{ m.content }}"
    "{%- else -%}<s>{{ m.content }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}:{%- endif -%}"
)
MAX_TURNS = 3
TURN_TOKENS = 14
TOOL_SHARE = 3  # of every 10 cold-start traces call the tool; the others answer at once


def tool_trace(tokenizer, prompt: str, answer: str, use_tool: bool = True) -> tuple[list[int], list[int]]:
    """One trajectory's tokens and labels (-100 on the prompt and the tool's tokens): the tool
    called and its result copied, or (`use_tool` False) the answer given at once."""
    env = Calculator()
    conversation = env.reset({"prompt": prompt, "answer": answer})
    ids = render(tokenizer, [], conversation)
    labels = [-100] * len(ids)
    for turn in (f"calc({prompt.rstrip('=')})", answer) if use_tool else (answer,):
        sampled = [*tokenizer.encode(turn, add_special_tokens=False), tokenizer.eos_token_id]
        ids = ids + sampled
        labels = labels + sampled
        step = env.step(turn)
        if step.done:
            break
        conversation.append(Message("assistant", turn))
        observation = render(tokenizer, conversation, step.observation, sampled)
        conversation += step.observation
        ids = ids + observation
        labels = labels + [-100] * len(observation)
    return ids, labels


def _batch(rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return ids, labels


class _HFEngine:
    """The minimal engine `play` needs: transformers' generate, one sequence a call, greedy at
    temperature 0."""

    name = "hf"
    capabilities = None

    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.eos = tokenizer.eos_token_id

    def start(self, prompt, sampling, return_trace=False, index=0):
        import concurrent.futures

        from shared.engines.base import Sample

        sampled = (
            {"do_sample": True, "temperature": sampling.temperature, "top_k": 0}
            if sampling.temperature
            else {"do_sample": False}
        )
        out = self.model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.eos,
            pad_token_id=0,
            **sampled,
        )
        tokens = out[0, len(prompt) :].tolist()
        future = concurrent.futures.Future()
        future.set_result(Sample(tokens, [0.0] * len(tokens), [0] * len(tokens), "stop"))
        return future


@torch.no_grad()
def tool_accuracy(
    model, tokenizer, examples, temperature: float = 0.0, max_turns: int = MAX_TURNS, seed: int = 0
) -> dict[str, float]:
    """Multi-turn accuracy (reward 1) and tool-call success over `examples`, each played by the
    Calculator as a replica plays it; greedy at temperature 0, else sampled (seeded)."""
    from shared.engines.base import Sampling
    from shared.envs.trajectory import Budget, TrajectoryError, play

    model.eval()
    torch.manual_seed(seed)
    engine = _HFEngine(model, tokenizer)
    budget = Budget(max_turns=max_turns, max_tokens=TURN_TOKENS * max_turns)
    sampling = Sampling(temperature=temperature, max_new_tokens=TURN_TOKENS)

    async def one(example):
        try:
            return await play(
                engine, tokenizer, Calculator(), {"prompt": example.prompt, "answer": example.answer}, sampling, budget
            )
        except TrajectoryError:  # e.g. over the budget: a failure like any other here
            return None

    async def all_of_them():
        return [await one(e) for e in examples]

    played = [t for t in asyncio.run(all_of_them()) if t is not None]
    return {
        "accuracy": sum(t.reward for t in played) / len(examples),
        "tool_success": sum(t.env_metrics.get("tool_success", 0.0) for t in played) / len(examples),
    }


def tool_cold_start(model, tokenizer, spec, seed: int, progress: BuildProgress | None = None) -> dict:
    """SFT on the traces until the accuracy of sampled (temperature 1) trajectories reaches
    spec.target_accuracy (or max steps): RL then starts from a reward it can see. Its steps and
    each measurement are shown by `progress`."""
    progress = progress or BuildProgress("a kit model")
    task = MulTask(seed=seed)
    train = [
        tool_trace(tokenizer, e.prompt, e.answer, use_tool=i % 10 < TOOL_SHARE)
        for i, e in enumerate(task.split("train", 2000))
    ]
    evaluation = task.split("eval", spec.sft_eval_size)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    scores = tool_accuracy(model, tokenizer, evaluation, 1.0, seed=seed)
    step = 0
    measured = f"sampled accuracy {scores['accuracy']:.3f} (stops at {spec.target_accuracy:g})"
    progress.step("SFT step", step, spec.sft_max_steps, measured, now=True)
    while scores["accuracy"] < spec.target_accuracy and step < spec.sft_max_steps:
        model.train()
        for _ in range(spec.sft_eval_every):
            pick = torch.randint(len(train), (spec.sft_batch_size,), generator=generator).tolist()
            ids, labels = _batch([train[i] for i in pick])
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            progress.step("SFT step", step, spec.sft_max_steps, measured)
        scores = tool_accuracy(model, tokenizer, evaluation, 1.0, seed=seed)
        measured = (
            f"loss {loss.item():.3f}, sampled accuracy {scores['accuracy']:.3f} (stops at {spec.target_accuracy:g}),"
            f" tool success {scores['tool_success']:.3f}"
        )
        progress.step("SFT step", step, spec.sft_max_steps, measured, now=True)
    greedy = tool_accuracy(model, tokenizer, evaluation)
    return {
        "sft_steps": step,
        "sampled_accuracy": scores["accuracy"],
        "sampled_tool_success": scores["tool_success"],
        "greedy_accuracy": greedy["accuracy"],
        "greedy_tool_success": greedy["tool_success"],
    }
