"""The agent endpoint's calls, one by one, against the real app and a real engine: a refused
call is answered with a JSON 4xx and changes nothing of its session, a
large body is refused without holding the other sessions, and no documentation route is served."""

import asyncio
import json
import time

import httpx
import pytest

from services.inference.agents import Endpoint
from shared.engines import Sampling, make_engine
from shared.envs.trajectory import Budget
from shared.models import load_tokenizer
from shared.rpc.steadyrl.v1 import common_pb2

TASK = common_pb2.PromptTask(task_id="t")
GOOD = {"messages": [{"role": "user", "content": "12*34="}], "max_tokens": 6}
REFUSED = [  # (what the call sets, the status it gets)
    ({"temperature": 1e-40}, 400),
    ({"temperature": float("inf")}, 400),
    ({"temperature": "hot"}, 400),
    ({"temperature": True}, 400),
    ({"top_p": 0}, 400),
    ({"top_p": 2}, 400),
    ({"max_tokens": 1e400}, 400),
    ({"max_tokens": -3}, 400),
    ({"max_tokens": 2.5}, 400),
    ({"max_completion_tokens": "6"}, 400),
    ({"messages": [{"role": "user", "content": {"text": 1}}]}, 400),
    ({"messages": [{"role": 7, "content": "x"}]}, 400),
    ({"messages": []}, 400),
    ({"tools": "calc"}, 400),
    ({"n": 2}, 400),
    ({"stream": True}, 400),
    ({"logprobs": "yes"}, 400),
]


@pytest.fixture(scope="module")
def endpoint(calc_model_dir):
    engine = make_engine("torch", str(calc_model_dir), "float32")
    yield Endpoint(engine, load_tokenizer(str(calc_model_dir)), "http://test", max_body_bytes=64 << 10)
    engine.close()


def client(endpoint) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=endpoint.app()), base_url="http://test")


def test_refused_calls_change_nothing_and_the_trajectory_goes_on(endpoint):
    sampling = Sampling(temperature=1.0, max_new_tokens=6, seed=2)

    async def main():
        with endpoint.session(TASK, sampling, Budget(max_turns=3, max_tokens=40), False, 0) as (session, url):
            path = url.removeprefix("http://test") + "/chat/completions"
            auth = {"Authorization": f"Bearer {session.key}"}
            async with client(endpoint) as http:
                first = await http.post(path, json=GOOD, headers=auth)
                reply = first.json()["choices"][0]["message"]["content"] or ""
                before = (list(session.trajectory.token_ids), list(session.conversation), session.trajectory.turns)
                answers = []
                for change, _ in REFUSED:
                    body = {
                        **GOOD,
                        "messages": [
                            *GOOD["messages"],
                            {"role": "assistant", "content": reply},
                            {"role": "tool", "content": "= 408"},
                        ],
                        **change,
                    }
                    raw = json.dumps(body).replace("Infinity", "1e400")
                    answers.append(
                        await http.post(path, content=raw, headers={**auth, "Content-Type": "application/json"})
                    )
                after = (list(session.trajectory.token_ids), list(session.conversation), session.trajectory.turns)
                body = {
                    **GOOD,
                    "messages": [
                        *GOOD["messages"],
                        {"role": "assistant", "content": reply},
                        {"role": "tool", "content": "= 408"},
                    ],
                }
                second = await http.post(path, json=body, headers=auth)
                return first, before, answers, after, second, session

    first, before, answers, after, second, session = asyncio.run(main())
    assert first.status_code == 200
    assert [a.status_code for a in answers] == [status for _, status in REFUSED]
    assert all(a.json()["error"]["type"] == "invalid_request" for a in answers), [a.text for a in answers]
    assert after == before and session.error is None
    assert second.status_code == 200 and session.trajectory.turns == 2


def test_a_large_body_is_refused_and_the_other_sessions_are_served(endpoint):
    sampling = Sampling(temperature=1.0, max_new_tokens=6, seed=2)

    async def main():
        with (
            endpoint.session(TASK, sampling, Budget(max_turns=3, max_tokens=40), False, 0) as (big, big_url),
            endpoint.session(TASK, sampling, Budget(max_turns=3, max_tokens=40), False, 1) as (small, small_url),
        ):
            async with client(endpoint) as http:
                huge = json.dumps({"messages": [{"role": "user", "content": "1" * (5 << 20)}]})

                async def timed(url, key, content):
                    started = time.monotonic()
                    reply = await http.post(
                        url.removeprefix("http://test") + "/chat/completions",
                        content=content,
                        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                    )
                    return reply, time.monotonic() - started

                return await asyncio.gather(
                    timed(big_url, big.key, huge), timed(small_url, small.key, json.dumps(GOOD))
                ), big

    ((large, _), (normal, _)), big = asyncio.run(main())
    assert large.status_code == 413 and large.json()["error"]["type"] == "too_large"
    assert normal.status_code == 200 and big.trajectory is None


def test_no_documentation_route_and_unknown_sessions_are_json(endpoint):
    async def main():
        async with client(endpoint) as http:
            return [await http.get(path) for path in ("/docs", "/openapi.json", "/redoc")], await http.post(
                "/rollouts/nobody/v1/chat/completions", json=GOOD
            )

    docs, unknown = asyncio.run(main())
    assert [d.status_code for d in docs] == [404, 404, 404]
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found"
