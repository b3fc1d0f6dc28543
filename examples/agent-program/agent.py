"""An agent program: it knows nothing of steadyrl and needs nothing but the Python standard library.

It speaks the OpenAI chat API at $OPENAI_BASE_URL with the key in $OPENAI_API_KEY (plain HTTP, no
SDK), starts from the task's prompt in $STEADYRL_PROMPT, runs its own calculator whenever the
model writes `calc(A*B)` (or + or -) and sends the result back as a tool message, and prints the
model's final answer as its last line, which the run's reward scores. The replica runs it once
per trajectory and records every call it makes.
"""

import json
import operator
import os
import re
import urllib.request

CALL = re.compile(r"calc\((\d+)([-+*])(\d+)\)")
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def chat(messages: list[dict]) -> str:
    """One chat completion: the assistant's reply to `messages`."""
    body = {"model": "policy", "messages": messages}  # sampling: the run's (temperature, max_tokens may be set)
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"] or ""


def main() -> None:
    messages = [{"role": "user", "content": os.environ["STEADYRL_PROMPT"]}]
    for _ in range(3):  # the recipe's trajectory.max_turns
        reply = chat(messages)
        messages.append({"role": "assistant", "content": reply})
        call = CALL.search(reply)
        if call is None:  # no tool call: this is the answer
            break
        a, op, b = call.groups()
        messages.append({"role": "tool", "content": f"= {OPERATIONS[op](int(a), int(b))}"})
    print(messages[-1]["content"] if messages[-1]["role"] == "assistant" else "")


if __name__ == "__main__":
    main()
