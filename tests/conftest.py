"""Shared fixtures: the cold-started tiny model (cached by content)."""

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The default tiny Qwen3-MoE, cold-started on arith (built once per cache, then reused)."""
    from shared.models.tiny import init_tiny_model

    return init_tiny_model()
