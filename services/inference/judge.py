"""A rollout replica's side of model-judged rewards: each finished group of a `judge:NAME` or
`reward_model:NAME` task is sent to the judge pool, one text per completion (template NAME filled
with the prompt, the completion and the answer), and the verdicts become the rewards. A verdict the
rule cannot read scores 0 with its reason; a pool that is down, slow or answers garbage fails the
call after its bounded attempts (`PoolError`), and the worker hands the task back.

Details: docs/guides/pools.md"""

from __future__ import annotations

import asyncio
import math

from services.inference.config import JudgeTemplate
from shared.rpc.pool_client import PoolClient
from shared.rpc.steadyrl.v1 import inference_pb2 as pb
from shared.tasks.judging import VerdictError, model_reward, parse_verdict, render
from shared.tasks.reward_runner import RewardRunner, Score


def reply_problem(reply: pb.JudgeReply, count: int, kind: str) -> str:
    """Why a judge's reply cannot be used ('' when it can): one verdict per text, each a finite
    scalar from a reward model or a text from a generative judge."""
    if len(reply.verdicts) != count:
        return f"{len(reply.verdicts)} verdicts for {count} texts"
    for i, verdict in enumerate(reply.verdicts):
        if kind == "reward_model" and not (verdict.HasField("score") and math.isfinite(verdict.score)):
            return f"verdict {i}: no finite score from a reward model"
        if kind == "judge" and verdict.HasField("score"):
            return f"verdict {i}: a score where a generative judge's text was asked (the pool serves a reward model)"
    return ""


class JudgeScoring:
    """The judge pool's client and the templates of [inference.judge]."""

    def __init__(self, client: PoolClient | None, templates: dict[str, JudgeTemplate], rewards: RewardRunner) -> None:
        self.client = client
        self.templates = templates
        self.rewards = rewards

    @staticmethod
    def judges(reward: str) -> bool:
        return model_reward(reward) is not None

    def check(self, reward: str) -> None:
        """KeyError when this replica cannot score `reward` (no pool, or no such template)."""
        _, name = model_reward(reward)
        if self.client is None:
            raise KeyError(f"{reward!r} needs a judge pool and this replica has none ([judge] in the recipe)")
        if name not in self.templates:
            raise KeyError(f"{reward!r}: no template {name!r} in inference.judge.templates {sorted(self.templates)}")

    async def score(
        self, reward: str, prompt: str, completions: list[str], answer: str
    ) -> tuple[list[Score], list[float] | None]:
        """Each completion's reward from the pool's verdicts, and (with the template's
        `compare_with`) the rule reward of each for the agreement; raises PoolError."""
        kind, name = model_reward(reward)
        template = self.templates[name]
        texts = [render(template.prompt, prompt, c, answer) for c in completions]
        request = pb.JudgeRequest(texts=texts, max_new_tokens=template.max_new_tokens)
        reply = await self.client.call("Judge", request, check=lambda r: reply_problem(r, len(texts), kind))
        scores = [verdict_score(v, kind, template) for v in reply.verdicts]
        reference = None
        if template.compare_with:
            rule = await asyncio.to_thread(self.rewards.score, template.compare_with, completions, answer)
            reference = [s.value for s in rule]
        return scores, reference


def verdict_score(verdict: pb.JudgeVerdict, kind: str, template: JudgeTemplate) -> Score:
    if kind == "reward_model":
        return Score(float(verdict.score))
    try:
        return Score(parse_verdict(verdict.text, template.rule, template.labels))
    except VerdictError as exc:
        return Score(0.0, exc.reason)
