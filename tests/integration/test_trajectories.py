"""Multi-turn trajectories for real: the torch engine and the tiny model against environments —
the model's turns and the environment's answers interleaved, the loss mask marking the model's
tokens, through a plain rendering and a chat template; an environment that raises, hangs,
answers malformed or overflows the budget ends the trajectory with a named reason."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shared.engines import Sampling, make_engine
from shared.envs.base import Environment, Message, SingleTurn, Step
from shared.envs.calc import Calculator, evaluate
from shared.envs.trajectory import Budget, TrajectoryError, run_trajectory
from shared.kit.tiny import char_tokenizer
from shared.rollouts.record import Rollout, validate_rollout

ROOT = Path(__file__).resolve().parents[2]


class Scripted(Environment):
    """Answers every turn with `observation` until `turns` turns, then done with reward 1."""

    def __init__(self, turns: int, observation: str = "=42") -> None:
        self.turns = turns
        self.observation = observation
        self.seen = []

    def reset(self, task):
        return [Message("user", task["prompt"])]

    def step(self, model_turn):
        self.seen.append(model_turn)
        done = len(self.seen) >= self.turns
        return Step([] if done else [Message("tool", self.observation)], float(done), done)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = make_engine("torch", str(tiny_model_dir), "float32")
    yield engine
    engine.close()


SAMPLING = Sampling(temperature=1.0, max_new_tokens=4, seed=7, ignore_eos=True)


def test_three_turns_interleave_the_model_and_the_environment(engine):
    tokenizer = char_tokenizer()  # a bare template: the tiny model's context is 64 tokens
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    env = Scripted(3)
    t = run_trajectory(engine, tokenizer, env, {"prompt": "12*3="}, SAMPLING)
    assert (t.turns, t.finish_reason, t.reward) == (3, "done", 1.0)
    observation = tokenizer.encode("=42", add_special_tokens=False)
    assert t.loss_mask == [True] * 4 + [False] * 3 + [True] * 4 + [False] * 3 + [True] * 4
    assert t.token_ids[4:7] == t.token_ids[11:14] == observation  # the environment's tokens, as rendered
    model = np.array(t.loss_mask)
    assert all(lp < 0 for lp in np.array(t.logprobs)[model]) and not np.array(t.logprobs)[~model].any()
    assert [tokenizer.decode(t.token_ids[i : i + 4], skip_special_tokens=True) for i in (0, 7, 14)] == env.seen
    rollout = Rollout(
        rollout_id="t:0",
        group_id="t",
        prompt_token_ids=np.array(t.prompt_token_ids, dtype=np.int32),
        reward=t.reward,
        **t.arrays(),
    )
    validate_rollout(rollout)  # a record the trainer takes
    assert t.prompt_token_ids == tokenizer.encode("12*3=", add_special_tokens=False)


def test_without_a_chat_template_turns_are_plain_lines(engine):
    tokenizer = char_tokenizer()
    t = run_trajectory(engine, tokenizer, Scripted(2), {"prompt": "12*3="}, SAMPLING)
    observation = tokenizer.encode("\ntool: =42\nassistant: ", add_special_tokens=False)
    assert t.prompt_token_ids == tokenizer.encode("user: 12*3=\nassistant: ", add_special_tokens=False)
    assert t.token_ids[4:-4] == observation and t.loss_mask == [True] * 4 + [False] * len(observation) + [True] * 4


def test_a_chat_template_renders_each_observation_after_the_model_s_tokens(engine):
    tokenizer = char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    t = run_trajectory(engine, tokenizer, Scripted(2, "=7"), {"prompt": "3+4="}, SAMPLING)
    observation = tokenizer.encode("\n<tool>=7\n<assistant>", add_special_tokens=False)
    assert t.token_ids[4 : 4 + len(observation)] == observation and t.loss_mask[4 : 4 + len(observation)] == [
        False
    ] * len(observation)
    assert t.turns == 2 and sum(t.loss_mask) == 8


def test_budgets_end_a_trajectory(engine):
    tokenizer = char_tokenizer()
    assert (
        run_trajectory(engine, tokenizer, Scripted(9), {"prompt": "1="}, SAMPLING, Budget(max_turns=2)).finish_reason
        == "max_turns"
    )
    with pytest.raises(TrajectoryError, match="over_budget"):
        run_trajectory(
            engine, tokenizer, Scripted(9, "=" + "9" * 50), {"prompt": "1="}, SAMPLING, Budget(max_tokens=30)
        )
    one = run_trajectory(
        engine,
        tokenizer,
        SingleTurn(lambda answer, ref: float(answer == ref)),
        {"prompt": "1+1=", "answer": "2"},
        SAMPLING,
    )
    assert one.turns == 1 and one.finish_reason == "done" and all(one.loss_mask)  # the one-step case


class Raises(Scripted):
    def step(self, model_turn):
        raise KeyError("broken tool")


class Hangs(Scripted):
    def step(self, model_turn):
        time.sleep(30)


class Malformed(Scripted):
    def step(self, model_turn):
        return Step("not messages", 0.0, False)


class BadInfo(Scripted):
    def step(self, model_turn):
        return Step([Message("tool", "=1")], 0.0, False, {"calls": float("nan")})


class BadReward(Scripted):
    def step(self, model_turn):
        return Step([], "one", True)


@pytest.mark.parametrize(
    "env,code",
    [
        (Raises(3), "env_error"),
        (Hangs(3), "env_timeout"),
        (Malformed(3), "malformed_observation"),
        (BadInfo(3), "malformed_observation"),
        (BadReward(3), "malformed_observation"),
    ],
)
def test_a_bad_environment_ends_the_trajectory_with_its_reason(engine, env, code):
    started = time.monotonic()
    with pytest.raises(TrajectoryError) as caught:
        run_trajectory(engine, char_tokenizer(), env, {"prompt": "2*2="}, SAMPLING, Budget(env_seconds=1.0))
    assert caught.value.code == code and time.monotonic() - started < 10
    assert run_trajectory(engine, char_tokenizer(), Scripted(1), {"prompt": "2*2="}, SAMPLING).turns == 1  # serving


def test_the_calculator_answers_calls_and_scores_answers():
    env = Calculator()
    assert env.reset({"prompt": "12*34=", "answer": "408"}) == [Message("user", "12*34=")]
    assert env.step("calc(2**99)") == Step(
        [Message("tool", "error: bad expression")], 0.0, False, {"tool_calls": 1.0, "tool_errors": 1.0}
    )  # short, whatever was written
    with pytest.raises(ValueError, match="not an integer expression"):
        evaluate("2**99")
    assert env.step(" 407 ") == Step([], 0.0, True, {"tool_success": 0.0})  # no call computed the answer
    assert env.step("let me calc(12*34)") == Step([Message("tool", "= 408")], 0.0, False, {"tool_calls": 1.0})
    assert env.step("calc(" + "9*" * 30 + "9)").observation[0].content == "error: too large"
    assert env.step(" 408 ") == Step([], 1.0, True, {"tool_success": 1.0})
    assert env.step("407") == Step([], 0.0, True, {"tool_success": 1.0})
    assert evaluate("-(3+4)*2") == -14 and env.tools[0].openai()["function"]["name"] == "calc"


def test_routing_traces_compose_turn_by_turn_and_info_sums(engine, tiny_model_dir):
    """Each position keeps the routing of the forward that first computed it: with one version
    throughout, equal to a fresh forward of the whole trajectory; the environment's counts sum."""
    from shared.models import load_causal_lm
    from tests.envs import Echo
    from tests.integration.test_inference import fresh_forward

    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    t = run_trajectory(engine, tokenizer, Echo(), {"prompt": "12*3="}, SAMPLING, return_trace=True)
    assert (t.turns, t.env_metrics, t.reward) == (3, {"tool_calls": 2.0, "answered": 1.0}, 1.0)
    logp, trace = fresh_forward(load_causal_lm(tiny_model_dir, "float32"), t.prompt_token_ids, t.token_ids)
    np.testing.assert_array_equal(t.routing_trace, trace)
    assert t.routing_trace.shape[0] == len(t.prompt_token_ids) + len(t.token_ids) - 1
    mask = np.array(t.loss_mask)
    assert np.abs(logp.numpy()[mask] - np.array(t.logprobs)[mask]).max() <= 1e-5


def test_a_hung_environment_call_never_holds_the_process_at_its_exit():
    """The call that hung past its time limit is abandoned on its own daemon thread: the process
    exits at once (a pool's worker would be joined as the interpreter exits: for the hour)."""
    script = (
        "import asyncio, time\n"
        "from shared.envs.trajectory import TrajectoryError, _call\n"
        "try:\n"
        "    asyncio.run(_call(time.sleep, 3600, seconds=0.2, what='reset'))\n"
        "except TrajectoryError as exc:\n"
        "    print(exc.code, exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "env_timeout env_timeout: reset took over 0.2 s"
