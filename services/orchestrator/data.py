"""The run's data: train and eval examples (never overlapping unless allowed) and the prompt tasks
made from them, each carrying what its reward takes of its dataset row (none: nothing)."""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from services.orchestrator.config import DataSettings, DataSource, MixtureSource, OrchestratorSettings
from services.orchestrator.mixture import MixturePlan
from shared.envs.calc import MulTask
from shared.rpc.steadyrl.v1 import common_pb2
from shared.tasks import ArithTask, Example, MathTask
from shared.tasks.judging import is_model_reward
from shared.tasks.prompt_tokenizer import encode_prompts, load_prompt_tokenizer
from shared.tasks.registry import load_reward
from shared.tasks.reward_contract import Reward
from shared.tasks.trace import MulTraceTask

PROMPTS_CACHED = 65_536  # tokenized prompts kept (a few MB at most)

TRAIN_ID = re.compile(r"^train-(\d+)$")  # a train task's id: train-<its number in the run>


def rule_reward(name: str) -> Reward | None:
    """The rule reward `name` as loaded here, to read what it takes of a row; None for a model-judged
    one or one that cannot load here (its tasks then carry no row)."""
    if not name or is_model_reward(name):
        return None
    try:
        return load_reward(name)
    except KeyError:
        return None


def takes_row(settings: OrchestratorSettings, default: str) -> bool:
    """Whether a reward of a source's tasks (the run's, else the task's `default`; the evals' own)
    takes the dataset row: then its examples keep their rows' columns."""
    names = {settings.reward or default, settings.evals.reward}
    return any(reward.takes_row for reward in map(rule_reward, names) if reward is not None)


def check_rows(settings: OrchestratorSettings) -> None:
    """ValueError naming the file and row of a dataset row the run's reward would get and cannot (the
    row's limits): `steadyrl run` calls it before any process starts, as the orchestrator loads them."""
    for data in settings.data.sources():
        if data.task == "math" and takes_row(settings, "math_verify"):
            dataset(settings, data if settings.data.mixture else None)


def dataset(settings: OrchestratorSettings, data: DataSource | None = None) -> tuple[list[Example], list[Example], str]:
    """(train, eval, reward) of source `data` (the run's [orchestrator.data] when it has no mixture);
    train and eval never share a problem unless allowed."""
    data = data or settings.data
    if isinstance(data, DataSettings) and data.mixture:
        raise ValueError("a data.mixture has a dataset per source: pass the source")
    if data.task == "arith":
        task = ArithTask(
            digits=data.arith_digits, seed=data.seed, fixed_width=data.arith_fixed_width, reverse=data.arith_reverse
        )
        train = task.split("train", min(data.train_size, task.max_split_size("train")))
        return train, task.split("eval", min(settings.evals.size, task.max_split_size("eval"))), "exact_match"
    if data.task == "calc":
        calc = MulTask(seed=data.seed)
        return (
            calc.split("train", min(data.train_size, calc.max_split_size("train"))),
            calc.split("eval", min(settings.evals.size, calc.max_split_size("eval"))),
            "exact_match",
        )
    if data.task == "verifiers":  # the environment's own rows; its rubric scores them on the replicas
        from shared.envs import verifiers_adapter

        return (
            verifiers_adapter.examples(settings.trajectory.environment, "train", data.train_size),
            verifiers_adapter.examples(settings.trajectory.environment, "eval", settings.evals.size),
            "exact_match",
        )
    if data.task == "mul_trace":
        trace = MulTraceTask(data.trace_max_answer_tokens, data.trace_alpha, seed=data.seed)
        return trace.split("train", data.train_size), trace.split("eval", settings.evals.size), "exact_match"
    if data.math_path is None:
        raise ValueError("data.task 'math' needs data.math_path")
    task = MathTask(
        str(data.math_path),
        str(data.math_eval_path) if data.math_eval_path else None,
        prompt_column=data.prompt_column,
        answer_column=data.answer_column,
        columns=takes_row(settings, "math_verify"),
    )
    if data.math_eval_path is None:  # hold the last evals.size rows out of training
        rows = task.split("train")
        if len(rows) <= settings.evals.size:
            raise ValueError(
                f"{data.math_path} has {len(rows)} rows: too few to hold out evals.size="
                f"{settings.evals.size} for evaluation (or give data.math_eval_path)"
            )
        return rows[: -settings.evals.size][: data.train_size], rows[-settings.evals.size :], "math_verify"
    train = task.split("train", data.train_size)
    evals = task.split("eval", settings.evals.size)
    refuse_overlap(data, train, evals, "eval problems")
    return train, evals, "math_verify"


def refuse_overlap(data: DataSource, train: list[Example], evals: list[Example], what: str) -> None:
    """ValueError when eval problems are also training problems (evals would measure memorisation),
    unless data.allow_eval_overlap."""
    overlap = sorted({e.prompt for e in train} & {e.prompt for e in evals})
    if overlap and not data.allow_eval_overlap:
        raise ValueError(
            f"{len(overlap)} {what} are also training problems (e.g. {overlap[0][:80]!r}); evals would "
            "measure memorisation. Remove them or set data.allow_eval_overlap = true"
        )


def eval_sets(settings: OrchestratorSettings, data: DataSource, train: list[Example]) -> dict[str, list[Example]]:
    """The named eval sets (`evals.sets`), at most evals.size problems each, read as problems of
    source `data`, none a training problem unless allowed."""
    template = {} if data.task == "math" else {"template": "{problem}"}
    columns = takes_row(settings, "math_verify" if data.task == "math" else "exact_match")
    out: dict[str, list[Example]] = {}
    for name, path in settings.evals.sets.items():
        out[name] = MathTask(
            str(path), prompt_column=data.prompt_column, answer_column=data.answer_column, columns=columns, **template
        ).split("train", settings.evals.size)
        refuse_overlap(data, train, out[name], f"problems of eval set {name!r}")
    return out


@dataclass(frozen=True)
class Source:
    """One training source of a run: its examples, the reward that scores them and the environment
    that plays them ('' for single-turn). A run without a mixture has one, named ''."""

    name: str
    data: DataSource
    train: list[Example]
    eval: list[Example]
    reward: str
    environment: str


class Tasks:
    """The examples of a run and the PromptTasks made of them (prompts tokenized here). `evals`:
    every eval set by name as (source, example) pairs: `main` (the task's own; a mixture's: the union
    of its sources' eval splits), each mixture source's, then `evals.sets` (of no source, made as the
    first source's problems)."""

    def __init__(self, settings: OrchestratorSettings) -> None:
        self.settings = settings
        self.sources: dict[str, Source] = {}
        for data in settings.data.sources():
            train, evals, reward = dataset(settings, data)
            name = data.name if isinstance(data, MixtureSource) else ""
            self.sources[name] = Source(
                name, data, train, evals, settings.reward or reward, settings.environment_of(data)
            )
        self.ordered = list(self.sources.values())  # the mixture plan's source indices
        self.first = self.ordered[0]
        self.reward = self.first.reward
        self.train = [e for source in self.ordered for e in source.train]
        self.plan = MixturePlan([getattr(source.data, "weight", 1.0) for source in self.ordered])
        mixture = bool(settings.data.mixture)
        if mixture:  # a problem trained through one source is no eval of another
            for source in self.ordered:
                refuse_overlap(source.data, self.train, source.eval, f"eval problems of source {source.name!r}")
        own = {source.name: [(source.name, e) for e in source.eval] for source in self.ordered}
        named = eval_sets(settings, self.first.data, self.train)
        self.evals = {
            "main": [pair for pairs in own.values() for pair in pairs],
            **(own if mixture else {}),
            **{name: [("", e) for e in examples] for name, examples in named.items()},
        }
        self.rewards: dict[str, Reward | None] = {}  # each task reward as loaded here, to read what it takes of a row
        self.tokenizer = load_prompt_tokenizer(settings.model_path)
        # (source, prompt) → its tokens, the newest PROMPTS_CACHED: a train cycle revisits its examples every epoch
        self._encoded: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()

    def train_task(self, i: int) -> tuple[str, Example]:
        """(source, example) of train task i: the source by the mixture's plan, the example its k-th
        of that source's, cycled over its training examples. O(1), the same for i whatever came before."""
        index, k = self.plan.task(i)
        source = self.ordered[index]
        return source.name, source.train[k % len(source.train)]

    def make_trains(self, first: int, min_versions: list[int]) -> list[common_pb2.PromptTask]:
        """Train tasks first, first + 1, ... (one a min version), their prompts tokenized together."""
        examples = map(self.train_task, range(first, first + len(min_versions)))
        self.encode([(source, example.prompt) for source, example in examples])
        return [self.make_train(first + j, v) for j, v in enumerate(min_versions)]

    def make_train(self, i: int, min_version: int) -> common_pb2.PromptTask:
        """Train task i (`train-i`), the same whenever it is made: its source's example, G samples at
        the run's temperature."""
        source, example = self.train_task(i)
        s = self.settings
        return self.make(f"train-{i}", example, s.group_size, s.sampling.temperature, False, min_version, source)

    def epoch(self, submitted: int) -> int:
        """Whole passes over every source's training examples among the first `submitted` tasks."""
        return min(self.plan.drawn(index, submitted) // len(source.train) for index, source in enumerate(self.ordered))

    def source(self, name: str) -> Source:
        """The source of this name; '' (a problem of no source, an evals.sets one): the first."""
        return self.sources[name] if name else self.first

    def prompt_ids(self, example: Example, source: str = "") -> list[int]:
        """The prompt's tokens: through the chat template (and system prompt) when its source asks."""
        self.encode([(source, example.prompt)])
        return list(self._encoded[(source, example.prompt)])

    def encode(self, prompts: list[tuple[str, str]]) -> None:
        """Tokenize the (source, prompt) pairs not cached yet, each source's in one batch call
        (the tokenizer's per-call overhead dwarfs a short prompt's own work)."""
        missing: dict[str, list[str]] = {}
        for source, prompt in prompts:
            if (source, prompt) in self._encoded:
                self._encoded.move_to_end((source, prompt))
            elif prompt not in missing.setdefault(source, []):
                missing[source].append(prompt)
        for source, texts in missing.items():
            data = self.source(source).data
            ids = encode_prompts(self.tokenizer, texts, data.chat_template == "auto", data.system_prompt)
            self._encoded.update(((source, t), tuple(i)) for t, i in zip(texts, ids, strict=True))
        while len(self._encoded) > PROMPTS_CACHED:
            self._encoded.popitem(last=False)

    def reward_row(self, reward: str, example: Example) -> str:
        """What `reward` takes of the example's row, as its task carries it ('' for nothing)."""
        if reward not in self.rewards:
            self.rewards[reward] = rule_reward(reward)
        loaded = self.rewards[reward]
        row = loaded.select(example.row()) if loaded is not None else None
        return row.to_json() if row is not None else ""

    def make(
        self,
        task_id: str,
        example: Example,
        group_size: int,
        temperature: float,
        is_eval: bool,
        min_version: int,
        source: str = "",
    ) -> common_pb2.PromptTask:
        """A PromptTask of `source`, scored by its reward; a multi-turn one carries its prompt as text,
        for the environment to open the conversation with (the replica renders it), and its environment
        and budget; each carries what its reward takes of the example's dataset row."""
        s = self.settings
        spec = self.source(source)
        environment = spec.environment
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
            else {"prompt_token_ids": self.prompt_ids(example, source)}
        )
        if s.sampling.overlong_buffer and not is_eval and not environment:  # evals score the answer alone
            turns["overlong"] = common_pb2.OverlongShaping(
                buffer_tokens=s.sampling.overlong_buffer, penalty=s.sampling.overlong_penalty
            )
        reward = s.evals.reward if is_eval and s.evals.reward else spec.reward
        return common_pb2.PromptTask(
            task_id=task_id,
            run_id=s.run_id,
            group_id=task_id,
            task_name=reward,
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
            source=source,
            reward_row=self.reward_row(reward, example),
        )
