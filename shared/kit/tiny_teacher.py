"""The tiny teacher: the kit's tiny policy trained further, supervised, on a format its cold start
never saw (2-digit sums without zero padding, "7+35=" → "24", the sum reversed), for on-policy
distillation on a laptop. The policy answers about a fifth of these problems; the teacher about
nine tenths, and a student distilled from it learns the format far sooner than by RL alone
(configs/tiny-distill.toml, `steadyrl bench pools`).

Details: docs/guides/pools.md"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch

from shared.kit.build_progress import BuildProgress
from shared.kit.tiny import (
    TinySpec,
    building,
    cache_key,
    char_tokenizer,
    cold_start,
    default_cache_dir,
    deliver,
    deterministic,
    greedy_accuracy,
    init_tiny_model,
    save_kit_model,
)
from shared.tasks.arith import ArithTask

TEACHER_KEY = "arith_unpadded_teacher-2"
# all 3,000 steps, no early stop: stopping at the first eval past a target would pick the checkpoint on
# the very problems its accuracy is then read on (0.92 on those 300, 0.896 on 1,200 others)
TEACHER_SPEC = TinySpec(sft_lr=3e-3, sft_max_steps=3000, sft_eval_every=250, sft_eval_size=300, target_accuracy=1.01)


def teacher_task(seed: int = 0) -> ArithTask:
    """The teacher's task: the demo's 2-digit sums, reversed, without zero padding (what a recipe
    sets with orchestrator.data.arith_fixed_width = false)."""
    return ArithTask(digits=2, seed=seed, fixed_width=False, reverse=True)


def init_tiny_teacher(
    out: str | Path | None = None, seed: int = 0, spec: TinySpec | None = None, cache_dir: Path | None = None
) -> Path:
    """Build (or reuse from the cache) the tiny teacher from the kit's tiny policy of `seed`; copy it
    to `out` if given. Its report holds the policy's greedy accuracy on the teacher's held-out
    problems before (`student_accuracy`) and the teacher's after (`held_out`)."""
    spec = spec or TEACHER_SPEC
    student = init_tiny_model(seed=seed, cache_dir=cache_dir)
    key = {"teacher": TEACHER_KEY, "student": student.name}
    cached = (cache_dir or default_cache_dir()) / cache_key(spec, key, seed)
    with building(cached) as needed:
        if needed:
            from transformers import AutoModelForCausalLM

            started = time.perf_counter()
            progress = BuildProgress(f"the kit's tiny teacher (seed {seed})")
            with deterministic():
                tokenizer = char_tokenizer()
                model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
                task = teacher_task(seed)
                before = greedy_accuracy(model, tokenizer, task.split("eval", spec.sft_eval_size))
                report = cold_start(model, tokenizer, task, spec, seed, progress)
            report.update(
                task=TEACHER_KEY,
                seed=seed,
                student=student.name,
                student_accuracy=round(before, 4),
                held_out=round(report.pop("greedy_accuracy"), 4),
                init_seconds=round(time.perf_counter() - started, 2),
                spec=asdict(spec),
            )
            save_kit_model(cached, model, tokenizer, report)
            progress.built(f"{report['sft_steps']} SFT steps, cached in {cached}")
    return deliver(cached, out)
