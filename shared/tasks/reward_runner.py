"""Rewards with a time limit that works on any thread.

Replicas score completions on their engine thread, where `signal.alarm` (math-verify's own time
limit) cannot work. `RewardRunner` runs every reward that is not registered `inline` in a child
process (`shared.tasks.reward_worker`, JSON lines over its stdin/stdout: no pickle). Each
completion gets `timeout` seconds; a reward that hangs is killed with its process (reason
`timeout`) and a fresh process takes the rest. A call that raises, hangs or returns a non-finite
value is a failed call, not a zero: it is tried again, up to `retries` times, and a completion
whose every call failed keeps the last reason — the trainer leaves it out of the loss. Nothing a
reward does stops the caller.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from shared.tasks.registry import is_inline, load_reward, resolve_reward, score
from shared.tasks.reward_contract import Reward, Row

log = logging.getLogger("steadyrl.rewards")


@dataclass(frozen=True)
class Score:
    value: float
    reason: str = ""  # '' = a good value; else why it failed (value 0): timeout, error:<type>, nonfinite, ...
    failures: tuple[str, ...] = ()  # the reasons of every failed call, retried ones included


class _Worker:
    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "shared.tasks.reward_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            bufsize=0,
        )
        self.buffer = b""

    def send(self, requests: list[dict]) -> None:
        self.process.stdin.write(b"".join(json.dumps(r).encode() + b"\n" for r in requests))
        self.process.stdin.flush()

    def reply(self, deadline: float) -> dict | None:
        """The next reply, or None when none arrives by `deadline` (or the process died)."""
        fd = self.process.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()


class RewardRunner:
    """Score completions against an answer. Thread-safe; one reward process, started on demand."""

    def __init__(self, timeout: float = 10.0, retries: int = 0) -> None:
        self.timeout = timeout
        self.retries = retries  # calls again for a completion whose call failed
        self._worker: _Worker | None = None
        self._lock = threading.Lock()
        self._loaded: dict[str, Reward] = {}  # each reward's signature, read once

    def check(self, name: str) -> None:
        """Raise KeyError now if `name` is neither a registered reward nor an importable path."""
        self.reward(name)

    def reward(self, name: str) -> Reward:
        """The reward `name`, loaded once (KeyError when unknown)."""
        if name not in self._loaded:
            self._loaded[name] = load_reward(name)
        return self._loaded[name]

    def score(self, name: str, completions: list[str], answer: str, row: Row | None = None) -> list[Score]:
        """Each completion's reward: its failed calls tried again (`retries`), each Score carrying
        the reasons of its failed calls and, when none succeeded, the last as its reason. `row`: the
        task's dataset row, of which the reward gets what it takes (nothing: called as (completion, answer))."""
        try:
            row = self.reward(name).select(row) if row is not None else None
        except KeyError:  # an unknown reward: every call fails, named, in the reward process
            row = None
        scores = self._score_once(name, completions, answer, row)
        failures: list[tuple[str, ...]] = [(s.reason,) if s.reason else () for s in scores]
        for _ in range(self.retries):
            again = [i for i, s in enumerate(scores) if s.reason]
            if not again:
                break
            retried_scores = self._score_once(name, [completions[i] for i in again], answer, row)
            for i, retried in zip(again, retried_scores, strict=True):
                scores[i] = retried
                failures[i] += (retried.reason,) if retried.reason else ()
        return [Score(s.value if not s.reason else 0.0, s.reason, f) for s, f in zip(scores, failures, strict=True)]

    def _score_once(self, name: str, completions: list[str], answer: str, row: Row | None) -> list[Score]:
        if is_inline(name):
            reward = self.reward(name)
            keywords = reward.keywords(row)
            return [Score(*score(reward.fn, c, answer, keywords)) for c in completions]
        with self._lock:
            return self._score_isolated(name, completions, answer, row)

    def _score_isolated(self, name: str, completions: list[str], answer: str, row: Row | None) -> list[Score]:
        out: list[Score] = []
        extra = {"row": row.to_object()} if row is not None else {}
        while len(out) < len(completions):
            worker = self._ensure_worker()
            requests = [{"reward": name, "completion": c, "answer": answer, **extra} for c in completions[len(out) :]]
            try:
                worker.send(requests)
            except OSError:  # the process died between two calls
                self._restart()
                worker = self._ensure_worker()
                worker.send(requests)
            for _ in requests:
                started = time.monotonic()
                reply = worker.reply(started + self.timeout)
                if reply is None:
                    died = worker.process.poll() is not None
                    reason = "worker_died" if died else "timeout"
                    log.warning(
                        "event=reward_failed reward=%s reason=%s seconds=%.1f", name, reason, time.monotonic() - started
                    )
                    out.append(Score(0.0, reason))
                    self._restart()  # the rest go to a fresh process
                    break
                out.append(Score(float(reply["value"]), str(reply["reason"])))
        return out

    def _ensure_worker(self) -> _Worker:
        if self._worker is None or self._worker.process.poll() is not None:
            self._worker = _Worker()
        return self._worker

    def _restart(self) -> None:
        if self._worker is not None:
            self._worker.kill()
        self._worker = None

    def close(self) -> None:
        with self._lock:
            self._restart()


def check_reward(name: str, completion: str, answer: str, timeout: float = 10.0, row: Row | None = None) -> float:
    """Load a reward (registered name or `module:function`), check it takes (completion, answer)
    with a default for any other parameter, and call it once in a reward process with a time limit,
    given what it takes of `row` as a run's task gives it (default: an empty prompt, no column): its
    value, or ValueError saying why it cannot serve a run (not importable, wrong signature, raises,
    hangs, not a finite number)."""
    import inspect

    try:
        fn = resolve_reward(name)
    except KeyError as exc:
        raise ValueError(str(exc.args[0] if exc.args else exc)) from None
    try:
        signature = inspect.signature(fn)
        signature.bind("completion", "answer")
        lost = [p.name for p in list(signature.parameters.values())[2:] if p.kind is p.POSITIONAL_ONLY]
        if lost:  # the row comes by keyword: such a parameter would only ever get its default
            raise TypeError(f"{', '.join(lost)} positional-only: the prompt and the row's columns come by keyword")
    except TypeError as exc:
        raise ValueError(
            f"reward {name!r} must take (completion, answer), any other parameter with a default (a task "
            f"without that column calls it without): {exc}"
        ) from None
    except ValueError:  # a builtin without a signature: the dry call below decides
        pass
    runner = RewardRunner(timeout)
    try:
        (result,) = runner.score(name, [completion], answer, Row(prompt="") if row is None else row)
    finally:
        runner.close()
    if result.reason:
        raise ValueError(f"reward {name!r} failed its dry call on one example: {result.reason}")
    return result.value
