"""`steadyrl eval` on the tiny model: greedy accuracy equals transformers' own greedy decoding."""

import json
import subprocess
import sys

from shared.models import load_causal_lm
from shared.models.tiny import TinySpec, char_tokenizer, greedy_accuracy


def test_eval_command_greedy_matches_hf_generate(tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "steadyrl.cli", "eval", str(tiny_model_dir), "--size", "60",
                           "--samples", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    expected = greedy_accuracy(load_causal_lm(tiny_model_dir, "float32"), char_tokenizer(),
                               TinySpec().task().split("eval", 60))
    assert report["prompts"] == 60 and report["greedy_accuracy"] == round(expected, 4)
    assert 0.0 <= report["sampled_accuracy"] <= 1.0 and report["samples_per_prompt"] == 2
