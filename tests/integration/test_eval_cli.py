"""`steadyrl eval` on the tiny model: the run's eval sets, prompts and reward, offline. Greedy
accuracy equals transformers' own greedy decoding, set by set."""

import csv
import json
import subprocess

import torch

from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts, greedy_accuracy
from shared.models import load_causal_lm


def eval_cli(*args: str) -> subprocess.CompletedProcess:
    """`steadyrl eval ARGS` in this process (typer's runner: the command's exit code, stdout and
    stderr), sparing each call an interpreter start."""
    from typer.testing import CliRunner

    from steadyrl.cli import app

    done = CliRunner().invoke(app, ["eval", *args])
    return subprocess.CompletedProcess(["steadyrl", "eval", *args], done.exit_code, done.stdout, done.stderr)


def report_of(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_eval_scores_the_recipes_eval_sets_as_its_run_does(tiny_model_dir, tmp_path):
    model = load_causal_lm(tiny_model_dir, "float32")
    tokenizer = char_tokenizer()
    examples = TinySpec().task().split("eval", 64)
    with (tmp_path / "hard.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["question", "solution"])
        writer.writerows([e.prompt, e.answer] for e in examples[40:64])
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        "[orchestrator.evals]\nsize = 40\n[orchestrator.sampling]\nmax_new_tokens = 8\n"
        '[orchestrator.data]\nprompt_column = "question"\nanswer_column = "solution"\n'
        f'[orchestrator.evals.sets]\nhard = "{tmp_path / "hard.csv"}"\n'
    )

    report = report_of(eval_cli(str(tiny_model_dir), "--config", str(recipe), "--samples", "2"))
    assert report["task"] == "arith" and report["reward"] == "exact_match"
    assert report["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # --device auto
    assert report["prompts"] == 40 and report["accuracy"] == round(greedy_accuracy(model, tokenizer, examples[:40]), 4)
    hard = report["sets"]["hard"]
    assert hard["prompts"] == 24 and hard["accuracy"] == round(greedy_accuracy(model, tokenizer, examples[40:64]), 4)
    for scores in (report, hard):
        assert scores["k"] == 2 and 0.0 <= scores["mean_at_k"] <= scores["pass_at_k"] <= 1.0

    # a shortcut flag is an override of the same recipe; --samples 0 is greedy only
    smaller = report_of(eval_cli(str(tiny_model_dir), "--config", str(recipe), "--size", "10", "--samples", "0"))
    assert smaller["prompts"] == 10 and smaller["sets"]["hard"]["prompts"] == 10 and "k" not in smaller
    assert smaller["accuracy"] == round(greedy_accuracy(model, tokenizer, examples[:10]), 4)


def test_eval_uses_the_recipes_reward_plug_in(tiny_model_dir):
    """`tests.rewards:length` scores a completion by its length: the greedy 'accuracy' is the mean
    length of transformers' greedy completions, computed in a reward process."""
    model = load_causal_lm(tiny_model_dir, "float32")
    tokenizer = char_tokenizer()
    examples = TinySpec().task().split("eval", 12)
    report = report_of(
        eval_cli(
            str(tiny_model_dir),
            "--set",
            "orchestrator.reward=tests.rewards:length",
            "--size",
            "12",
            "--max-new-tokens",
            "6",
            "--samples",
            "0",
        )
    )
    ids = encode_prompts(tokenizer, [e.prompt for e in examples])
    lengths = []
    with torch.no_grad():
        for row in ids:
            out = model.generate(
                input_ids=torch.tensor([row]),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=0,
            )
            lengths.append(len(tokenizer.decode(out[0, len(row) :].tolist(), skip_special_tokens=True)))
    assert report["reward"] == "tests.rewards:length" and report["prompts"] == 12
    assert report["accuracy"] == round(sum(lengths) / 12, 4) and report["accuracy"] > 0
    assert report["reward_failures"] == {}


def test_a_reward_that_fails_scores_zero_and_is_counted_with_the_recipes_time_limit(tiny_model_dir):
    common = ["--size", "2", "--max-new-tokens", "4", "--samples", "0"]
    hung = report_of(
        eval_cli(
            str(tiny_model_dir),
            "--set",
            "orchestrator.reward=tests.rewards:hang_after_dry_call",
            "--set",
            "inference.tasks.reward_timeout_seconds=1",
            *common,
        )
    )
    assert hung["accuracy"] == 0.0 and hung["reward_failures"] == {"timeout": 2}
    raised = report_of(
        eval_cli(str(tiny_model_dir), "--set", "orchestrator.reward=tests.rewards:explode_after_dry_call", *common)
    )
    assert raised["accuracy"] == 0.0 and raised["reward_failures"] == {"error:RuntimeError": 2}


def test_bad_eval_settings_are_refused_with_the_reason(tiny_model_dir, tmp_path):
    def refused(*args: str) -> str:
        done = eval_cli(str(tiny_model_dir), *args)
        assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
        return done.stderr

    assert "'mul_trace'" in refused("--task", "nope")
    assert "none.csv" in refused("--set", f'orchestrator.evals.sets={{x = "{tmp_path / "none.csv"}"}}')
    assert "nothing_here" in refused("--set", "orchestrator.reward=tests.rewards:nothing_here")
    assert "device must be one of ('auto', 'cpu', 'cuda'), got 'tpu'" in refused("--device", "tpu")
    if not torch.cuda.is_available():
        assert "asked for cuda and no CUDA device is visible" in refused("--device", "cuda", "--size", "2")


def test_served_scores_the_model_as_the_recipes_replicas_compute_it(tiny_model_dir):
    """--served: the inference dtype and quantization, not --dtype. The reference is transformers'
    greedy decoding of the model with its weights rounded through NVFP4 (fp32 compute, so batched
    and unbatched decoding agree)."""
    from shared.models.quantization import quantize_, quantized_targets

    model = load_causal_lm(tiny_model_dir, "float32")
    tokenizer = char_tokenizer()
    quantize_(model, quantized_targets(model), "fp4")
    examples = TinySpec().task().split("eval", 40)
    common = ["--size", "40", "--max-new-tokens", "8", "--samples", "0"]
    served = report_of(
        eval_cli(
            str(tiny_model_dir),
            "--served",
            "--dtype",
            "bfloat16",
            *common,
            "--set",
            'inference.dtype="float32"',
            "--set",
            'inference.quantization="fp4"',
        )
    )
    assert served["dtype"] == "float32" and served["quantization"] == {"quantization": "fp4"}
    assert served["accuracy"] == round(greedy_accuracy(model, tokenizer, examples), 4)
    plain = report_of(eval_cli(str(tiny_model_dir), *common, "--set", 'inference.quantization="fp4"'))
    assert plain["dtype"] == "float32" and "quantization" not in plain  # without --served: the model as given
    refused = eval_cli(
        str(tiny_model_dir),
        "--served",
        *common,
        "--set",
        'inference.engine="vllm"',
        "--set",
        'inference.quantization="fp8"',
    )
    assert (
        refused.returncode == 2 and "emulates the torch engine's fp8; this recipe serves it with vllm" in refused.stderr
    )
