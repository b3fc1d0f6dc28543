"""Every recipe in configs/ parses and every section validates against its service's settings."""

import tomllib
from pathlib import Path

import pytest

from shared.run_config import SERVICES, load_run_config, service_env, validate

ROOT = Path(__file__).resolve().parents[2]
GRIDS = {p for p in (ROOT / "configs").glob("*.toml") if "grid" in tomllib.loads(p.read_text())}  # experiment grids
CONFIGS = sorted(set((ROOT / "configs").glob("*.toml")) - GRIDS)
REQUIRED = {"trainer": {"model_path": "m"}, "inference": {"model_path": "m"}, "orchestrator": {"model_path": "m"},
            "weightsync": {}}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_recipe_validates(path):
    config = load_run_config(path)
    assert config.steps > 0 and config.replicas >= 1
    for service in SERVICES:
        validate(service, service_env(config, service, REQUIRED[service]))


def test_a_typo_names_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((ROOT / "configs" / "tiny-arith.toml").read_text().replace("lr = 1e-3", "learning_rate = 1e-3"))
    with pytest.raises(ValueError, match="learning_rate"):
        validate("trainer", service_env(load_run_config(bad), "trainer", REQUIRED["trainer"]))
    with pytest.raises(ValueError, match="section.key=value"):
        load_run_config(bad, ["steps=3"])
    overridden = load_run_config(ROOT / "configs" / "tiny-arith.toml", ["trainer.lr=3e-4", "run.steps=7"])
    assert overridden.section("trainer")["lr"] == 3e-4 and overridden.steps == 7
    env = service_env(overridden, "orchestrator", REQUIRED["orchestrator"])
    assert env["STEADYRL_ORCHESTRATOR_STEPS"] == "7" and env["STEADYRL_ORCHESTRATOR_RUN_ID"] == "tiny-arith"
