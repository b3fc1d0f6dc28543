"""The tiny-model kit: a small Qwen3-MoE and its character tokenizer, made locally and cold-started
on a task (`tiny.py`: arith, mul_trace; `tiny_tools.py`: the calc environment's multi-turn model),
so the demo and the tests run with no model hub."""
