"""The control plane's OpenAPI schema types every body and lists every status an operation answers;
its types are the code's (states, actions, queue depths). What the real app answers in each case:
tests/integration/test_control_plane_statuses.py."""

import dataclasses
import re
from typing import get_args, get_type_hints

import pytest

from services.orchestrator import api_models as api
from services.orchestrator.orchestrator import STATES, TRANSITIONS
from services.orchestrator.server import ACTIONS, create_app
from shared.runstore.queues import QueueDepths
from steadyrl import reference_docs


@pytest.fixture(scope="module")
def schema() -> dict:
    return create_app(None, None).openapi()


def test_every_operation_has_a_typed_reply(schema):
    replies = {
        (method, path): op["responses"]["200"]["content"]
        for path, ops in schema["paths"].items()
        for method, op in ops.items()
    }
    assert replies == {
        ("get", "/health"): {"application/json": {"schema": {"$ref": "#/components/schemas/Health"}}},
        ("get", "/metrics"): {"text/plain": {"schema": {"type": "string"}}},
        ("get", "/v1/run"): {"application/json": {"schema": {"$ref": "#/components/schemas/RunStatus"}}},
        ("get", "/v1/run/config"): {"application/json": {"schema": {"$ref": "#/components/schemas/RunConfig"}}},
        ("post", "/v1/run/{action}"): {"application/json": {"schema": {"$ref": "#/components/schemas/ActionReply"}}},
    }
    components = schema["components"]["schemas"]
    status = components["RunStatus"]
    assert status["additionalProperties"] is False  # a key the code sends must be declared
    assert len(status["properties"]) == 15 and set(status["required"]) == set(status["properties"]) - {
        "failure",
        "policy_evals",
        "stale",
    }
    assert status["properties"]["queue"] == {
        "$ref": "#/components/schemas/QueueDepths",
        "description": "The work queue's depths.",
    }
    assert status["properties"]["replica_versions"]["additionalProperties"] == {"type": "integer"}
    assert status["properties"]["state"]["enum"] == list(STATES)
    assert set(components["Stale"]["required"]) == {"read_unix_ms", "reason", "age_seconds"}
    assert components["ActionReply"]["properties"]["state"]["enum"] == ["running", "paused", "stopped"]
    assert components["RunConfig"]["type"] == "object" and components["RunConfig"]["additionalProperties"] is True
    assert "free-form" in components["RunConfig"]["description"]
    for name, component in components.items():
        assert component.get("description"), name
        for field, spec in component.get("properties", {}).items():
            assert spec.get("description"), f"{name}.{field}"


def test_every_status_is_listed_with_its_body(schema):
    statuses = {
        (method, path): {
            code: reply["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
            for code, reply in op["responses"].items()
            if code != "200"
        }
        for path, ops in schema["paths"].items()
        for method, op in ops.items()
    }
    assert statuses == {
        ("get", "/health"): {"413": "Error"},
        ("get", "/metrics"): {"413": "Error"},
        ("get", "/v1/run"): {"401": "Error", "413": "Error", "503": "Unavailable"},
        ("get", "/v1/run/config"): {"401": "Error", "413": "Error"},
        ("post", "/v1/run/{action}"): {
            "401": "Error",
            "404": "Error",
            "409": "Error",
            "413": "Error",
            "503": "Unavailable",
        },
    }
    act = schema["paths"]["/v1/run/{action}"]["post"]
    assert act["responses"]["503"]["headers"]["Retry-After"]["schema"] == {"type": "integer"}
    assert act["responses"]["401"]["headers"]["WWW-Authenticate"]["schema"] == {"type": "string"}
    assert act["parameters"] == [
        {
            "name": "action",
            "in": "path",
            "required": True,
            "description": "The transition; any other is refused with 404.",
            "schema": {"title": "Action", "type": "string", "enum": ["start", "pause", "resume", "stop"]},
        }
    ]
    assert "HTTPValidationError" not in schema["components"]["schemas"]  # nothing a client sends is validated


def test_the_declared_types_are_the_codes():
    assert get_args(api.RunState) == STATES
    assert ACTIONS == get_args(api.Action) == ("start", "pause", "resume", "stop")
    assert set(get_args(api.Transitioned)) == {TRANSITIONS[action][1] for action in ACTIONS}
    assert list(get_type_hints(api.QueueDepths)) == [f.name for f in dataclasses.fields(QueueDepths)]


def test_the_rest_page_links_every_body_to_its_schema():
    text = reference_docs.rest_page()
    run = text.split("## GET `/v1/run` ", 1)[1].split("\n## ", 1)[0]
    rows = {line.split(" | ")[0]: line for line in run.splitlines() if line.startswith("| `")}
    assert rows["| `200`"].endswith("| `application/json` [`RunStatus`](#schema-runstatus) |")
    assert rows["| `503`"].endswith("| `application/json` [`Unavailable`](#schema-unavailable) |")
    assert "<br>Header `Retry-After`: Seconds to wait: `retry_after_seconds`." in rows["| `503`"]
    status = text.split("## Schema `RunStatus`", 1)[1].split("\n## ", 1)[0]
    assert "| `progress` | [`Progress`](#schema-progress) | yes |" in status
    assert "| `stale` | [`Stale`](#schema-stale) | no |" in status
    assert "| `replica_versions` | object of `integer` | yes |" in status
    sections = re.findall(r"^## Schema `(\w+)`", text, re.M)
    assert sections.index("RunStatus") < sections.index("Progress") < sections.index("Unavailable")  # nested after
    anchors = set(re.findall(r"\{ #([\w-]+) \}", text))
    assert set(re.findall(r"\]\(#([\w-]+)\)", text)) <= anchors  # every link lands
