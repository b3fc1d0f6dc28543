"""The tiny judge: a tiny model trained by the kit to say whether an answer to the arith task is
right, for `judge:` rewards on a laptop. It reads "07+35=240?" and writes the right answer, then its
verdict: "240 y" or "240 n" (its template's `verdict_pattern` reads that line whole). Half its
training pairs are wrong answers, mostly the kit's tiny
policy's own (a judge of synthetic misses alone copies a plausible answer instead of checking it).
It stops once it agrees with exact match on held-out synthetic pairs and on the policy's samples.

Details: docs/guides/pools.md"""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from shared.kit.build_progress import BuildProgress
from shared.kit.tiny import (
    TinySpec,
    build_model,
    building,
    cache_key,
    char_tokenizer,
    default_cache_dir,
    deliver,
    deterministic,
    greedy_texts,
    save_kit_model,
    sft_batch,
)
from shared.tasks import Example
from shared.tasks.judging import VerdictError, parse_verdict, render

JUDGE_KEY = "arith_judge-3"
TEMPLATE = "{prompt}{response}?"  # [inference.judge.templates.NAME] prompt of the tiny judge
PATTERN = r"\d{1,4} (?P<verdict>[yn])"  # ... its verdict: its working, a space, y or n (the whole line)
RULE = "yes_no"
MAX_NEW_TOKENS = 6  # the answer (3 digits), a space, the verdict, EOS
JUDGE_SPEC = TinySpec(sft_lr=3e-3, sft_max_steps=8000, sft_eval_every=500, sft_eval_size=300, target_accuracy=0.98)
DIGITS = "0123456789"
POLICY_SHARE = 0.6  # of the wrong candidates of a problem the policy answered wrongly: one of its answers
POLICY_NEW_TOKENS = 6  # the policy's answers it learns from: as long as the demo's completions
POLICY_SAMPLES = 4  # samples of the tiny policy per train problem (temperature 1)


def candidate(answer: str, rng: random.Random, misses: list[str] = ()) -> str:
    """An answer to judge: the right one half the time, else a wrong one — one of `misses` (the
    policy's wrong answers to this problem) when there are some, at POLICY_SHARE, else most often
    one digit off by one (a carry), one digit changed, random digits, or a wrong length."""
    if rng.random() < 0.5:
        return answer
    if misses and rng.random() < POLICY_SHARE:
        return rng.choice(misses)
    draw = rng.random()
    if draw < 0.75:
        i = rng.randrange(len(answer))
        if draw < 0.5:
            digit = str((int(answer[i]) + rng.choice((-1, 1))) % 10)
        else:
            digit = rng.choice([d for d in DIGITS if d != answer[i]])
        return answer[:i] + digit + answer[i + 1 :]
    if draw < 0.85:
        return "".join(rng.choice(DIGITS) for _ in answer)
    return "".join(rng.choice(DIGITS) for _ in range(rng.choice([1, 2, len(answer) + 1])))


def judge_pair(
    example: Example, rng: random.Random, misses: dict[str, list[str]] | None = None
) -> tuple[Example, bool]:
    """(the judge's training example, whether the candidate it judges is right)."""
    response = candidate(example.answer, rng, (misses or {}).get(example.prompt, []))
    right = response == example.answer
    judged = render(TEMPLATE, example.prompt, response, example.answer)
    return Example(prompt=judged, answer=f"{example.answer} {'y' if right else 'n'}"), right


def verdicts(model, tokenizer, prompts: list[str]) -> list[float | None]:
    """The judge's reward for each filled template (None: a verdict the rule cannot read)."""
    out: list[float | None] = []
    for text in greedy_texts(model, tokenizer, prompts, MAX_NEW_TOKENS):
        try:
            out.append(parse_verdict(text, RULE, {}, pattern=PATTERN))
        except VerdictError:
            out.append(None)
    return out


def agreement(model, tokenizer, pairs: list[tuple[Example, bool]]) -> dict:
    """How often the judge's verdict equals exact match on `pairs`: over all, on right answers, on wrong ones."""
    said = verdicts(model, tokenizer, [example.prompt for example, _ in pairs])
    hits = [(value == 1.0) == right and value is not None for value, (_, right) in zip(said, pairs, strict=True)]

    def share(which: bool) -> float:
        chosen = [hit for hit, (_, right) in zip(hits, pairs, strict=True) if right == which]
        return round(sum(chosen) / max(len(chosen), 1), 4)

    return {
        "agreement": round(sum(hits) / len(hits), 4),
        "on_right": share(True),
        "on_wrong": share(False),
        "unreadable": sum(value is None for value in said),
        "pairs": len(pairs),
    }


def policy_answers(
    tokenizer, examples: list[Example], samples: int, seed: int, progress: BuildProgress | None = None
) -> list[list[str]]:
    """The kit's tiny policy's answers to each example, `samples` each at temperature 1 (the
    problems answered shown by `progress`)."""
    from shared.kit.tiny import encode_prompts, init_tiny_model
    from shared.models.loading import load_causal_lm

    progress = progress or BuildProgress("a kit model")
    policy = load_causal_lm(init_tiny_model())
    torch.manual_seed(seed)
    out: list[list[str]] = [[] for _ in examples]
    phase = f"sampling the tiny policy's answers ({samples} each), problem"
    progress.step(phase, 0, len(examples), now=True)
    with torch.no_grad():
        for start in range(0, len(examples), 500):
            ids = encode_prompts(tokenizer, [e.prompt for e in examples[start : start + 500]])
            width = max(map(len, ids))
            input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
            attention = (torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in ids])[:, None]).long()
            for _ in range(samples):
                rows = policy.generate(
                    input_ids=input_ids,
                    attention_mask=attention,
                    max_new_tokens=POLICY_NEW_TOKENS,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=0,
                )[:, width:].tolist()
                for i, row in enumerate(rows):
                    out[start + i].append(tokenizer.decode(row, skip_special_tokens=True))
            done = min(start + 500, len(examples))
            progress.step(phase, done, len(examples), now=done == len(examples))
    return out


def train_judge(model, tokenizer, spec: TinySpec, seed: int, progress: BuildProgress | None = None) -> dict:
    """Supervised training on judge pairs until the agreement on both held-out sets (synthetic pairs,
    the policy's own samples) reaches the target (or max steps), each phase shown by `progress`."""
    progress = progress or BuildProgress("a kit model")
    task = spec.task(seed)
    train = task.split("train", task.max_split_size("train"))
    held = task.split("eval", spec.sft_eval_size)
    misses = {
        e.prompt: sorted({a for a in answers if a != e.answer})
        for e, answers in zip(train, policy_answers(tokenizer, train, POLICY_SAMPLES, seed, progress), strict=True)
    }
    held_out = [judge_pair(e, random.Random(f"{seed}:{i}")) for i, e in enumerate(held)]
    sampled = [
        (Example(prompt=render(TEMPLATE, e.prompt, a[0], e.answer), answer=""), a[0] == e.answer)
        for e, a in zip(held, policy_answers(tokenizer, held, 1, seed + 1, progress), strict=True)
    ]
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)

    def measure() -> dict:
        return {
            "held_out": agreement(model, tokenizer, held_out),
            "held_out_policy": agreement(model, tokenizer, sampled),
        }

    def agreed() -> str:
        least = min(m["agreement"] for m in measured.values())
        return f"agreement {least:.3f} (stops at {spec.target_accuracy:g})"

    measured = measure()
    step = 0
    progress.step("SFT step", step, spec.sft_max_steps, agreed(), now=True)
    while min(m["agreement"] for m in measured.values()) < spec.target_accuracy and step < spec.sft_max_steps:
        model.train()
        note = agreed()
        for _ in range(spec.sft_eval_every):
            pick = torch.randint(len(train), (spec.sft_batch_size,), generator=generator).tolist()
            ids, labels = sft_batch(tokenizer, [judge_pair(train[i], rng, misses)[0] for i in pick])
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            progress.step("SFT step", step, spec.sft_max_steps, note)
        measured = measure()
        progress.step("SFT step", step, spec.sft_max_steps, f"loss {loss.item():.3f}, {agreed()}", now=True)
    return {"sft_steps": step, **measured, "policy_misses": sum(map(len, misses.values()))}


def init_tiny_judge(
    out: str | Path | None = None, seed: int = 0, spec: TinySpec | None = None, cache_dir: Path | None = None
) -> Path:
    """Build (or reuse from the cache) the tiny judge; copy it to `out` if given."""
    spec = spec or JUDGE_SPEC
    cached = (cache_dir or default_cache_dir()) / cache_key(spec, JUDGE_KEY, seed)
    with building(cached) as needed:
        if needed:
            started = time.perf_counter()
            progress = BuildProgress(f"the kit's tiny judge (seed {seed})")
            with deterministic():
                tokenizer = char_tokenizer()
                model = build_model(spec, seed)
                report = train_judge(model, tokenizer, spec, seed, progress)
            report.update(
                task=JUDGE_KEY,
                seed=seed,
                template=TEMPLATE,
                verdict_pattern=PATTERN,
                rule=RULE,
                max_new_tokens=MAX_NEW_TOKENS,
                init_seconds=round(time.perf_counter() - started, 2),
                spec=asdict(spec),
            )
            save_kit_model(cached, model, tokenizer, report)
            progress.built(f"{report['sft_steps']} SFT steps, cached in {cached}")
    return deliver(cached, out)
