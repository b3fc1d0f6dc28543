"""The run's data: train and eval examples (never overlapping unless allowed) and the prompt tasks
made from them."""

from __future__ import annotations

import re

from services.orchestrator.config import OrchestratorSettings
from shared.envs.calc import MulTask
from shared.models import load_tokenizer
from shared.models.loading import encode_prompt
from shared.rpc.steadyrl.v1 import common_pb2
from shared.tasks import ArithTask, Example, MathTask
from shared.tasks.trace import MulTraceTask

TRAIN_ID = re.compile(r"^train-(\d+)$")  # a train task's id: train-<its number in the run>


def dataset(settings: OrchestratorSettings) -> tuple[list[Example], list[Example], str]:
    """(train, eval, reward) of the run; train and eval never share a problem unless allowed."""
    if settings.data.task == "arith":
        task = ArithTask(
            digits=settings.data.arith_digits,
            seed=settings.data.seed,
            fixed_width=settings.data.arith_fixed_width,
            reverse=settings.data.arith_reverse,
        )
        train = task.split("train", min(settings.data.train_size, task.max_split_size("train")))
        return train, task.split("eval", min(settings.evals.size, task.max_split_size("eval"))), "exact_match"
    if settings.data.task == "calc":
        calc = MulTask(seed=settings.data.seed)
        return (
            calc.split("train", min(settings.data.train_size, calc.max_split_size("train"))),
            calc.split("eval", min(settings.evals.size, calc.max_split_size("eval"))),
            "exact_match",
        )
    if settings.data.task == "verifiers":  # the environment's own rows; its rubric scores them on the replicas
        from shared.envs import verifiers_adapter

        return (
            verifiers_adapter.examples(settings.trajectory.environment, "train", settings.data.train_size),
            verifiers_adapter.examples(settings.trajectory.environment, "eval", settings.evals.size),
            "exact_match",
        )
    if settings.data.task == "mul_trace":
        trace = MulTraceTask(settings.data.trace_max_answer_tokens, settings.data.trace_alpha, seed=settings.data.seed)
        return trace.split("train", settings.data.train_size), trace.split("eval", settings.evals.size), "exact_match"
    if settings.data.math_path is None:
        raise ValueError("data.task 'math' needs data.math_path")
    task = MathTask(
        str(settings.data.math_path),
        str(settings.data.math_eval_path) if settings.data.math_eval_path else None,
        prompt_column=settings.data.prompt_column,
        answer_column=settings.data.answer_column,
    )
    if settings.data.math_eval_path is None:  # hold the last evals.size rows out of training
        rows = task.split("train")
        if len(rows) <= settings.evals.size:
            raise ValueError(
                f"{settings.data.math_path} has {len(rows)} rows: too few to hold out evals.size="
                f"{settings.evals.size} for evaluation (or give data.math_eval_path)"
            )
        return rows[: -settings.evals.size][: settings.data.train_size], rows[-settings.evals.size :], "math_verify"
    train = task.split("train", settings.data.train_size)
    evals = task.split("eval", settings.evals.size)
    refuse_overlap(settings, train, evals, "eval problems")
    return train, evals, "math_verify"


def refuse_overlap(settings: OrchestratorSettings, train: list[Example], evals: list[Example], what: str) -> None:
    """ValueError when eval problems are also training problems (evals would measure memorisation),
    unless allow_eval_overlap."""
    overlap = sorted({e.prompt for e in train} & {e.prompt for e in evals})
    if overlap and not settings.data.allow_eval_overlap:
        raise ValueError(
            f"{len(overlap)} {what} are also training problems (e.g. {overlap[0][:80]!r}); evals would "
            "measure memorisation. Remove them or set data.allow_eval_overlap = true"
        )


def eval_sets(settings: OrchestratorSettings, train: list[Example]) -> dict[str, list[Example]]:
    """The named eval sets (`evals.sets`), at most evals.size problems each, none a training problem
    unless allowed."""
    template = {} if settings.data.task == "math" else {"template": "{problem}"}
    out: dict[str, list[Example]] = {}
    for name, path in settings.evals.sets.items():
        out[name] = MathTask(
            str(path), prompt_column=settings.data.prompt_column, answer_column=settings.data.answer_column, **template
        ).split("train", settings.evals.size)
        refuse_overlap(settings, train, out[name], f"problems of eval set {name!r}")
    return out


class Tasks:
    """The examples of a run and the PromptTasks made of them (prompts tokenized here). `evals`:
    every eval set by name, the task's own first (`main`)."""

    def __init__(self, settings: OrchestratorSettings) -> None:
        self.settings = settings
        self.train, self.eval, self.reward = dataset(settings)
        self.evals = {"main": self.eval, **eval_sets(settings, self.train)}
        self.reward = settings.reward or self.reward
        self.tokenizer = load_tokenizer(settings.model_path)

    def prompt_ids(self, example: Example) -> list[int]:
        """The prompt's tokens: through the chat template (and system prompt) when the run asks."""
        return encode_prompt(
            self.tokenizer, example.prompt, self.settings.data.chat_template == "auto", self.settings.data.system_prompt
        )

    def make(
        self, task_id: str, example: Example, group_size: int, temperature: float, is_eval: bool, min_version: int
    ) -> common_pb2.PromptTask:
        """A PromptTask; a multi-turn one carries its prompt as text, for the environment to open the
        conversation with (the replica renders it), and its environment and budget."""
        s = self.settings
        environment = s.task_environment
        turns = (
            {
                "environment": environment,
                "prompt_text": example.prompt,
                "budget": common_pb2.TrajectoryBudget(
                    max_turns=s.trajectory.max_turns,
                    max_tokens=s.trajectory.max_tokens or s.sampling.max_new_tokens * s.trajectory.max_turns,
                    env_seconds=s.trajectory.env_seconds,
                ),
            }
            if environment
            else {"prompt_token_ids": self.prompt_ids(example)}
        )
        if s.sampling.overlong_buffer and not is_eval and not environment:  # evals score the answer alone
            turns["overlong"] = common_pb2.OverlongShaping(
                buffer_tokens=s.sampling.overlong_buffer, penalty=s.sampling.overlong_penalty
            )
        return common_pb2.PromptTask(
            task_id=task_id,
            run_id=s.run_id,
            group_id=task_id,
            task_name=self.reward,
            **turns,
            answer=example.answer,
            group_size=group_size,
            is_eval=is_eval,
            min_policy_version=min_version,
            sampling=common_pb2.SamplingParams(
                temperature=temperature,
                top_p=s.sampling.top_p if temperature else 1.0,
                max_new_tokens=s.sampling.max_new_tokens,
            ),
        )
