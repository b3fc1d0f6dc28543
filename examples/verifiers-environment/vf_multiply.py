"""A `verifiers` environment, written for verifiers alone (its classic API: `load_environment()`
returns a `vf.MultiTurnEnv` with a dataset and a rubric).

Two-digit multiplication with a calculator: a model turn that writes `calc(A*B)` gets `= RESULT`
back as a tool message; a turn without a call is the answer and ends the rollout. The rubric's
reward is `correct` (1 for the exact product); `used_calc` has weight 0, so it is reported as a
metric (`env_used_calc` in a run's metrics.jsonl) without changing the reward.
"""

import re

import verifiers as vf
from datasets import Dataset

CALL = re.compile(r"calc\((\d+)\*(\d+)\)")


def _last(messages) -> str:
    """The text of the last message (verifiers hands over message objects or dicts)."""
    if not messages:
        return ""
    last = messages[-1]
    return str((last.get("content") if isinstance(last, dict) else getattr(last, "content", "")) or "")


class Multiply(vf.MultiTurnEnv):
    @vf.stop
    async def answered(self, state: vf.State) -> bool:
        """Done once the model's last turn called no tool."""
        trajectory = state["trajectory"]
        return bool(trajectory) and CALL.search(_last(trajectory[-1]["completion"])) is None

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        a, b = CALL.search(_last(messages)).groups()
        return [vf.ToolMessage(role="tool", content=f"= {int(a) * int(b)}", tool_call_id="calc")]


def correct(completion, answer, **kwargs) -> float:
    return float(_last(completion).strip() == str(answer).strip())


def used_calc(completion, **kwargs) -> float:
    return float(any(CALL.search(_last([m])) for m in completion))


def load_environment(max_turns: int = 3) -> vf.Environment:
    rows = [{"question": f"{a}*{b}=", "answer": str(a * b)} for a in range(11, 99, 6) for b in range(12, 99, 9)]
    return Multiply(
        dataset=Dataset.from_list(rows[:-20]),
        eval_dataset=Dataset.from_list(rows[-20:]),
        rubric=vf.Rubric(funcs=[correct, used_calc], weights=[1.0, 0.0]),
        max_turns=max_turns,
    )
