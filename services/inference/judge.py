"""A rollout replica's side of model-judged rewards: each finished group of a `judge:NAME` or
`reward_model:NAME` task is sent to the judge pool, one text per completion (template NAME filled
with the prompt, the delimited completion and the answer), and the verdicts become the rewards.

Judge replicas are not trusted. A reply that is not one verdict per text, or holds a value outside
the template's range (checked in float32), is a failed attempt, tried again on the next replica; so
is one with a verdict the template's grammar cannot read, unless it is the last attempt, whose
unread verdicts become failed rewards (left out of the loss). A pool that fails every attempt fails
the call (`PoolError`), and the worker hands the task back.

Details: docs/guides/pools.md"""

from __future__ import annotations

import asyncio

from services.inference.config import JudgeTemplate
from shared.rpc.pool_client import PoolClient
from shared.rpc.steadyrl.v1 import inference_pb2 as pb
from shared.tasks.judging import VerdictError, in_range, model_reward, parse_verdict, render
from shared.tasks.reward_runner import RewardRunner, Score


def reply_problem(reply: pb.JudgeReply, count: int, kind: str, template: JudgeTemplate) -> str:
    """Why a judge's reply cannot be used ('' when it can), `code: detail`: one verdict per text, a
    reward model's scalar or a generative judge's text, and every value it gives within the
    template's range as a float32."""
    if len(reply.verdicts) != count:
        return f"verdict_count: {len(reply.verdicts)} verdicts for {count} texts"
    low, high = template.reward_range
    for i, verdict in enumerate(reply.verdicts):
        if kind == "reward_model":
            if not verdict.HasField("score"):
                return f"no_score: verdict {i}: no score from a reward model"
            if not in_range(verdict.score, template.reward_range):
                return f"out_of_range: verdict {i}: score {verdict.score:.4g} outside [{low:g}, {high:g}]"
            continue
        if verdict.HasField("score"):
            return f"score_not_text: verdict {i}: a score where a generative judge's text was asked"
        try:
            value = parse_verdict(
                verdict.text, template.rule, template.labels, template.anchor, template.verdict_pattern
            )
        except VerdictError:
            continue  # unread: `unread_problem` asks another replica
        if not in_range(value, template.reward_range):
            return f"out_of_range: verdict {i}: {value:.4g} outside [{low:g}, {high:g}]"
    return ""


def unread_problem(reply: pb.JudgeReply, kind: str, template: JudgeTemplate) -> str:
    """Why another replica may judge better ('' when it cannot): a verdict the grammar cannot read."""
    if kind == "reward_model":
        return ""
    for i, verdict in enumerate(reply.verdicts):
        try:
            parse_verdict(verdict.text, template.rule, template.labels, template.anchor, template.verdict_pattern)
        except VerdictError as exc:
            return f"unparsed: verdict {i}: {exc.reason}"
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
        texts = [judge_input(template, prompt, c, answer) for c in completions]
        request = pb.JudgeRequest(texts=texts, max_new_tokens=template.max_new_tokens)
        reply = await self.client.call(
            "Judge",
            request,
            check=lambda r: reply_problem(r, len(texts), kind, template),
            prefer=lambda r: unread_problem(r, kind, template),
        )
        scores = [verdict_score(v, kind, template) for v in reply.verdicts]
        reference = None
        if template.compare_with:
            rule = await asyncio.to_thread(self.rewards.score, template.compare_with, completions, answer)
            reference = [s.value for s in rule]
        return scores, reference


def judge_input(template: JudgeTemplate, prompt: str, completion: str, answer: str) -> str:
    """The text the judge reads for one completion: the template filled, the completion delimited."""
    anchor = template.anchor
    return render(template.prompt, prompt, completion, answer, template.markers, anchor, template.max_response_chars)


def verdict_score(verdict: pb.JudgeVerdict, kind: str, template: JudgeTemplate) -> Score:
    """A checked verdict's reward; one the grammar cannot read is a failed reward with its reason."""
    if kind == "reward_model":
        return Score(float(verdict.score))
    try:
        return Score(
            parse_verdict(verdict.text, template.rule, template.labels, template.anchor, template.verdict_pattern)
        )
    except VerdictError as exc:
        return Score(0.0, exc.reason)
