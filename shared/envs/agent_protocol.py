"""The agent-program wire protocol: how an `agent:COMMAND` program plays one trajectory.

The program knows nothing of steadyrl: the replica runs COMMAND once per trajectory with the variables
of `program_environment`, each `POST {OPENAI_BASE_URL}/chat/completions` it makes (OpenAI's chat
completions API, the session's key as `Authorization: Bearer KEY`) is one model turn, and the last
non-blank line it prints is its answer (`answer_of`), scored by the task's reward. The calls, replies
and refusals in full: docs/reference/python-api.md; the program's sandbox: docs/guides/multi-turn.md;
the replica's side: `services/inference/agents.py`.
"""

from __future__ import annotations

BASE_URL = "OPENAI_BASE_URL"
"""The variable that holds the session's OpenAI base URL."""
API_KEY = "OPENAI_API_KEY"
"""The variable that holds the session's key (a bearer token good for this trajectory only)."""
PROMPT = "STEADYRL_PROMPT"
"""The variable that holds the problem's prompt."""


def program_environment(base_url: str, key: str, prompt: str) -> dict[str, str]:
    """The variables the replica gives the program for one trajectory (beside `HOME`, `TMPDIR`, `LANG`,
    `PATH` and those `inference.agent.env` names)."""
    return {BASE_URL: base_url, API_KEY: key, PROMPT: prompt}


def answer_of(stdout: str) -> str:
    """The program's answer: the last non-blank line it printed ('' when it printed none)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    return lines[-1] if lines else ""
