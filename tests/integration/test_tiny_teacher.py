"""The kit's tiny teacher: the tiny policy trained further on sums without zero padding. A brief build
(250 steps) records the policy's accuracy on the teacher's held-out problems before and its own after,
measured again here; it is served as any model directory, and a second call reuses the cache."""

import dataclasses
import json

import torch
from transformers import AutoModelForCausalLM

from shared.kit.tiny import char_tokenizer, greedy_accuracy
from shared.kit.tiny_teacher import TEACHER_KEY, TEACHER_SPEC, init_tiny_teacher, teacher_task


def test_the_teacher_learns_the_format_its_student_never_saw(tiny_model_dir):
    assert teacher_task().example(7, 35).prompt == "7+35=" and teacher_task().example(7, 35).answer == "24"
    spec = dataclasses.replace(TEACHER_SPEC, sft_max_steps=250, sft_eval_every=250, sft_eval_size=100)
    path = init_tiny_teacher(spec=spec)
    report = json.loads((path / "steadyrl_tiny.json").read_text())
    assert report["task"] == TEACHER_KEY and report["sft_steps"] == 250
    assert report["student"] == tiny_model_dir.name
    problems = teacher_task().split("eval", 100)
    tokenizer = char_tokenizer()
    measured = {
        name: greedy_accuracy(AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32), tokenizer, problems)
        for name, where in (("student_accuracy", tiny_model_dir), ("held_out", path))
    }
    assert measured == {k: report[k] for k in measured}  # each figure of the report, measured again
    assert report["student_accuracy"] < 0.3 and report["held_out"] >= report["student_accuracy"] + 0.2
    stamp = (path / "steadyrl_tiny.json").stat().st_mtime_ns
    assert init_tiny_teacher(spec=spec) == path and (path / "steadyrl_tiny.json").stat().st_mtime_ns == stamp
