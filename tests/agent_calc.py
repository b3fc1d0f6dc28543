"""An agent program as a user would write it, knowing nothing of steadyrl: it speaks the OpenAI chat
API at $OPENAI_BASE_URL (plain HTTP, no SDK), runs its own calculator when the model writes
`calc(EXPRESSION)`, and prints the model's final answer as its last line.

    STEADYRL_PROMPT="12*34=" OPENAI_BASE_URL=http://…/v1 python -m tests.agent_calc [--fail | --hang | --silent]
"""

import json
import os
import re
import sys
import time
import urllib.request

CALL = re.compile(r"calc\(([0-9+\-* ()]*)\)")


def chat(messages: list[dict]) -> dict:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps(
            {
                "model": "any",
                "messages": messages,
                "max_tokens": 14,
                "temperature": 1.0,
                "logprobs": True,
                "tools": [{"type": "function", "function": {"name": "calc", "parameters": {}}}],
            }
        ).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def main() -> None:
    if "--fail" in sys.argv:
        sys.exit("the agent gave up")
    if "--hang" in sys.argv:
        time.sleep(3600)
    if "--silent" in sys.argv:
        print("no model call")
        return
    messages = [{"role": "user", "content": os.environ["STEADYRL_PROMPT"]}]
    for _ in range(3):
        reply = chat(messages)["choices"][0]["message"]
        messages.append({"role": "assistant", "content": reply["content"] or ""})
        call = CALL.search(reply["content"] or "")
        if call is None:
            break
        try:
            result = f"= {eval(call.group(1), {'__builtins__': {}})}"  # digits and + - * ( ) only
        except Exception:  # noqa: BLE001
            result = "error: bad expression"
        messages.append({"role": "tool", "content": result})
    print(messages[-1]["content"])


if __name__ == "__main__":
    main()
