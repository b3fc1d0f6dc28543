"""A `verifiers` environment as its users write one, knowing nothing of steadyrl (the classic API:
`load_environment()` → a `vf.MultiTurnEnv` with a dataset and a rubric): 2-digit multiplication
where the model may write `calc(EXPRESSION)` and reads `= RESULT` back as a tool message, the
kit's calc model's format; a turn without a call is its answer, rewarded by the rubric when exact.

`load_environment(mode=...)` makes broken variants for the adapter's tests: `raise` (env_response
raises), `hang` (env_response never returns)."""

import asyncio
import re

import verifiers as vf
from datasets import Dataset

CALL = re.compile(r"calc\(([0-9+\-* ()]*)\)")


class CalcEnv(vf.MultiTurnEnv):
    def __init__(self, mode: str = "", **kwargs):
        super().__init__(**kwargs)
        self.mode = mode

    @vf.stop
    async def answered(self, state: vf.State) -> bool:
        trajectory = state["trajectory"]
        return bool(trajectory) and CALL.search(_text(trajectory[-1]["completion"])) is None

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        if self.mode == "raise":
            raise RuntimeError("the tool is broken")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        call = CALL.search(_text(messages))
        try:
            result = f"= {eval(call.group(1), {'__builtins__': {}})}"  # digits and + - * ( ) only
        except Exception:  # noqa: BLE001
            result = "error: bad expression"
        return [vf.ToolMessage(role="tool", content=result, tool_call_id="calc")]


def _text(messages) -> str:
    last = messages[-1] if messages else None
    return str(getattr(last, "content", None) or "") if last is not None else ""


def correct(completion, answer, **kwargs) -> float:
    return float(_text(completion).strip() == str(answer).strip())


def load_environment(size: int = 64, mode: str = "", max_turns: int = 3) -> vf.Environment:
    rows = [{"question": f"{a}*{b}=", "answer": str(a * b)} for a in range(12, 99, 7) for b in range(13, 99, 11)]
    return CalcEnv(
        mode=mode,
        dataset=Dataset.from_list(rows[:size]),
        eval_dataset=Dataset.from_list(rows[-16:]),
        rubric=vf.Rubric(funcs=[correct]),
        max_turns=max_turns,
    )
