"""The reward process: `python -m shared.tasks.reward_worker`. Reads one JSON request per line on
stdin — {"reward": name, "completion": text, "answer": text}, and "row": {"prompt": text,
"columns": {...}} when the reward takes the task's dataset row — and writes one JSON reply per
line — {"value": float, "reason": str} — in order. Each reward is loaded once, what it takes of a
row read from its signature then (`shared.tasks.reward_contract.Reward`). Rewards run on this
process's main thread, so their own signal-based limits work too; the parent bounds the time of
each one regardless.

Anything a reward prints goes to stderr: stdout carries only the replies."""

from __future__ import annotations

import json
import logging
import os
import sys


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints cannot corrupt the replies
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled": the parent bounds it
    from shared.tasks.registry import load_reward, score
    from shared.tasks.reward_contract import Reward, Row

    cache: dict[str, Reward] = {}
    for line in sys.stdin:
        try:
            request = json.loads(line)
            name = request["reward"]
            if name not in cache:
                cache[name] = load_reward(name)
            reward = cache[name]
            row = Row.from_object(request["row"]) if request.get("row") is not None else None
            value, reason = score(reward.fn, str(request["completion"]), str(request["answer"]), reward.keywords(row))
        except KeyError as exc:
            value = 0.0
            reason = f"unknown_reward:{exc}"[:200]
        except ValueError:
            value = 0.0
            reason = "bad_request"
        replies.write(json.dumps({"value": value, "reason": reason}) + "\n")


if __name__ == "__main__":
    main()
