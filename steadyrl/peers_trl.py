"""The TRL side of `steadyrl bench peers`: TRL's GRPOTrainer on steadyrl's recipe (the same model,
train problems in the same order, exact-match reward, batch geometry, sampling, optimizer and
loss), saving the model every `every` steps for the shared eval loop. Runs in a venv with TRL
(the `compare` extra); prints one JSON object: the config it used and each saved step's seconds.

    python -m steadyrl.peers_trl MODEL_DIR RECIPE STEPS EVERY OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# What the comparison sets beyond the recipe, each to TRL's fastest for this workload (printed with the result)
CHOSEN = {
    "gradient_checkpointing": (
        False,
        "TRL's default (on) recomputes every activation of a model that fits in memory many times over",
    ),
    "top_k": (0, "the recipe samples from the whole vocabulary"),
}


def grpo_config(recipe: dict, orchestrator, steps: int, out: Path) -> dict:
    """GRPOConfig's arguments matched to the recipe: G samples of B prompts per step, one update
    per batch, no KL, advantage R − group mean (no std scaling), token-mean loss over the batch;
    and `CHOSEN`, TRL at its best for this workload."""
    from services.trainer.config import OptimSettings

    run = recipe["run"]
    optim = OptimSettings(**recipe.get("trainer", {}).get("optim", {}))
    return {
        "output_dir": str(out / "trl"),
        "max_steps": steps,
        "per_device_train_batch_size": run["batch_prompts"] * run["group_size"],
        "num_generations": run["group_size"],
        "gradient_accumulation_steps": 1,
        "num_iterations": 1,
        "max_completion_length": orchestrator.sampling.max_new_tokens,
        "temperature": orchestrator.sampling.temperature,
        "top_p": orchestrator.sampling.top_p,
        "learning_rate": optim.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": optim.weight_decay,
        "adam_beta1": optim.adam_betas[0],
        "adam_beta2": optim.adam_betas[1],
        "max_grad_norm": optim.grad_clip,
        "beta": 0.0,
        "scale_rewards": "none",
        "loss_type": "dapo",
        "shuffle_dataset": False,
        "use_cpu": True,
        "bf16": False,
        "seed": 0,
        "logging_steps": 10,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        **{name: value for name, (value, _) in CHOSEN.items()},
    }


def main(model_dir: str, recipe_path: str, steps: int, every: int, out_dir: str) -> dict:
    import tomllib

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from shared.tasks.arith import exact_match
    from steadyrl.evaluation import eval_settings

    started = time.perf_counter()
    torch.set_num_threads(1)
    out = Path(out_dir)
    recipe = tomllib.loads(Path(recipe_path).read_text())
    settings, _ = eval_settings(model_dir, [Path(recipe_path)])
    from services.orchestrator.data import dataset

    train, _, _ = dataset(settings)  # the orchestrator's problems, in its order (task i is train[i % len])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bos = tokenizer.bos_token or ""  # steadyrl's prompts start with BOS (shared.models.loading.encode_prompt)
    prompts = recipe["run"]["batch_prompts"] * steps
    rows = [
        {"prompt": bos + train[i % len(train)].prompt, "answer": train[i % len(train)].answer} for i in range(prompts)
    ]

    def reward(completions: list[str], answer: list[str], **_) -> list[float]:
        return [exact_match(c, a) for c, a in zip(completions, answer, strict=True)]

    saved: list[dict] = []

    class Saver(TrainerCallback):
        """The model every `every` steps, the seconds since step 1 ended with saving left out."""

        def __init__(self) -> None:
            self.zero = None
            self.excluded = 0.0

        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.perf_counter()
            if self.zero is None:
                self.zero = now
            if state.global_step % every == 0 or state.global_step == steps:
                model.save_pretrained(out / f"step-{state.global_step:06d}", safe_serialization=True)
                tokenizer.save_pretrained(out / f"step-{state.global_step:06d}")
                saved.append({"step": state.global_step, "seconds": round(now - self.zero - self.excluded, 3)})
                self.excluded += time.perf_counter() - now

    config = grpo_config(recipe, settings, steps, out)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**config),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Saver()],
    )
    trainer.train()
    return {"config": config, "saved": saved, "seconds": round(time.perf_counter() - started, 2)}


if __name__ == "__main__":
    model_dir, recipe_path, steps, every, out_dir = sys.argv[1:6]
    print(json.dumps(main(model_dir, recipe_path, int(steps), int(every), out_dir)))
