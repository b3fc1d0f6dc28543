"""Every recipe in configs/ parses and every section validates against its service's settings."""

import re
import tomllib
from pathlib import Path

import pytest

from steadyrl.recipe import PROBES, SERVICES, load_recipe
from steadyrl.service_settings import service_env, validate

ROOT = Path(__file__).resolve().parents[2]
GRIDS = {p for p in (ROOT / "configs").glob("*.toml") if "grid" in tomllib.loads(p.read_text())}  # experiment grids
CONFIGS = sorted(set((ROOT / "configs").glob("*.toml")) - GRIDS)
REQUIRED = PROBES  # the values only a deployment knows, as `steadyrl run` checks a recipe


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_recipe_validates(path):
    config = load_recipe(path)
    assert config.steps > 0 and config.replicas >= 1
    for service in SERVICES:
        validate(service, service_env(config, service, REQUIRED[service]))


PLACED = {  # what `steadyrl run` places, as it would
    "trainer": {
        "port": 7001,
        "metrics_port": 0,
        "out_dir": "out/trainer",
        "weightsync_address": "127.0.0.1:7000",
        "publish": {"signing_key_file": "keys/sign"},
        "redis_url": "redis://:pw@127.0.0.1:7005/0",
    },
    "inference": {
        "port": 7002,
        "replica_id": "replica-0",
        "verify_key_file": "keys/verify",
        "agent": {"hidden_paths": ["out"]},
        "redis_url": "redis://:pw@127.0.0.1:7005/0",
    },
    "orchestrator": {"grpc_port": 7003, "http_port": 7004, "token": "a-token-of-the-run"},
    "weightsync": {"port": 7000, "verify_key_file": "keys/verify", "spill_dir": "out/spill"},
}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_service_is_typed_once_and_its_process_reads_the_same_object(path):
    """The recipe's sections are the services' own settings objects; a process given the variables
    generated from its object (`settings_env`) reads back exactly that object, secrets included."""
    from services.trainer.config import TrainerSettings
    from steadyrl.service_settings import build_settings, settings_class, settings_env, settings_for

    config = load_recipe(path)
    assert isinstance(config.trainer, TrainerSettings) and config.trainer.max_staleness == config.run.max_staleness
    for service in SERVICES:
        assert isinstance(config.settings(service), settings_class(service))
        assert config.settings(service).run_id == config.run_id
        settings = settings_for(config, service, PLACED[service], "model")
        env = settings_env(settings)
        assert all(k.startswith(f"STEADYRL_{service.upper()}_") for k in env)
        read = build_settings(service, env)
        assert read.model_dump(mode="json", exclude={"consumer"}) == settings.model_dump(
            mode="json", exclude={"consumer"}
        )
        assert read.redis_url.get_secret_value() == settings.redis_url.get_secret_value()
    orchestrator = build_settings(
        "orchestrator", settings_env(settings_for(config, "orchestrator", PLACED["orchestrator"]))
    )
    assert orchestrator.token.get_secret_value() == "a-token-of-the-run"


def test_a_typo_names_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((ROOT / "configs" / "tiny-arith.toml").read_text().replace("lr = 1e-3", "learning_rate = 1e-3"))
    with pytest.raises(ValueError, match="learning_rate"):
        validate("trainer", service_env(load_recipe(bad), "trainer", REQUIRED["trainer"]))
    with pytest.raises(ValueError, match="section.key=value"):
        load_recipe(bad, ["steps=3"])
    overridden = load_recipe(ROOT / "configs" / "tiny-arith.toml", ["trainer.optim.lr=3e-4", "run.steps=7"])
    assert overridden.section("trainer")["optim"]["lr"] == 3e-4 and overridden.steps == 7
    env = service_env(overridden, "orchestrator", REQUIRED["orchestrator"])
    assert env["STEADYRL_ORCHESTRATOR_STEPS"] == "7" and env["STEADYRL_ORCHESTRATOR_RUN_ID"] == "tiny-arith"
    with pytest.raises(ValueError, match=r"\[model\][\s\S]*pth[\s\S]*Extra inputs"):  # not silently the tiny model
        load_recipe(ROOT / "configs" / "tiny-arith.toml", ['model.pth="/models/qwen"'])
    with pytest.raises(ValueError, match=r"\[model\][\s\S]*path[\s\S]*at least 1 character"):
        load_recipe(ROOT / "configs" / "tiny-arith.toml", ['model.path=""'])
    assert load_recipe(ROOT / "configs" / "tiny-arith.toml", ['model.path="/m"']).model.path == "/m"


@pytest.mark.process  # starts a steadyrl process: not in the fast tier
def test_a_bad_value_fails_before_any_process_starts(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / "tiny-arith.toml"),
            "--out",
            str(out),
            "--set",
            "trainer.loss.eps_low=1.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "eps_low must lie in [0, 1)" in done.stderr and "loss" in done.stderr
    assert not out.exists()  # nothing started, nothing written


def test_services_cannot_disagree_on_what_run_declares():
    with pytest.raises(ValueError, match=r"\[trainer\] sets \['group_size'\].*run.group_size"):
        load_recipe(ROOT / "configs" / "tiny-arith.toml", ["trainer.group_size=4"])
    with pytest.raises(ValueError, match=r"\[orchestrator\] sets \['batch_prompts'\]"):
        load_recipe(ROOT / "configs" / "tiny-arith.toml", ["orchestrator.batch_prompts=4"])
    config = load_recipe(ROOT / "configs" / "tiny-arith.toml", ["run.group_size=4"])
    trainer = service_env(config, "trainer", REQUIRED["trainer"])
    orchestrator = service_env(config, "orchestrator", REQUIRED["orchestrator"])
    assert trainer["STEADYRL_TRAINER_GROUP_SIZE"] == orchestrator["STEADYRL_ORCHESTRATOR_GROUP_SIZE"] == "4"
    with pytest.raises(ValueError, match="group_size"):
        load_recipe(ROOT / "configs" / "tiny-arith.toml", ["run.group_size=0"])


def test_nested_settings_travel_as_env_and_validate_from_it_alone(monkeypatch):
    from steadyrl.service_settings import build_settings

    monkeypatch.setenv("STEADYRL_TRAINER_OPTIM__LR", "0.5")  # this process's environment is not the service's
    config = load_recipe(
        ROOT / "configs" / "tiny-arith.toml", ["trainer.loss.eps_high=0.3", "trainer.loss.normalization=sequence"]
    )
    env = service_env(config, "trainer", REQUIRED["trainer"])
    assert env["STEADYRL_TRAINER_LOSS__EPS_HIGH"] == "0.3"
    settings = build_settings("trainer", env)
    assert settings.loss.eps_high == 0.3 and settings.loss.normalization == "sequence" and settings.optim.lr == 1e-3
    assert env["STEADYRL_TRAINER_OPTIM__LR"] == "0.001" and env["STEADYRL_TRAINER_CHECKPOINT__EVERY"] == "10"


@pytest.mark.parametrize(
    "where, service, old, new",
    [
        ("recipe", "trainer", "lr = 1e-3", "trainer.lr is now trainer.optim.lr"),
        ("recipe", "trainer", 'parallel = "fsdp"', "trainer.parallel is now trainer.parallel.mode"),
        (
            "set",
            "inference",
            "inference.lease_seconds=3",
            "inference.lease_seconds is now inference.tasks.lease_seconds",
        ),
        ("set", "orchestrator", "orchestrator.eval_every=2", "orchestrator.eval_every is now orchestrator.evals.every"),
        (
            "env",
            "trainer",
            "STEADYRL_TRAINER_CHECKPOINT_EVERY",
            "trainer.checkpoint_every is now trainer.checkpoint.every",
        ),
        (
            "env",
            "inference",
            "STEADYRL_INFERENCE_AGENT_ISOLATION",
            "inference.agent_isolation is now inference.agent.isolation",
        ),
        (
            "kwarg",
            "orchestrator",
            "max_new_tokens",
            "orchestrator.max_new_tokens is now orchestrator.sampling.max_new_tokens",
        ),
    ],
)
def test_an_old_flat_setting_is_refused_with_its_new_name(tmp_path, monkeypatch, where, service, old, new):
    from steadyrl.service_settings import settings_class

    recipe = ROOT / "configs" / "tiny-arith.toml"
    if where == "recipe":
        recipe = tmp_path / "old.toml"
        recipe.write_text(
            (ROOT / "configs" / "tiny-arith.toml").read_text().replace("[trainer]\n", f"[trainer]\n{old}\n")
        )
    if where in ("recipe", "set"):  # refused where the recipe is loaded, before any process starts
        with pytest.raises(ValueError, match=re.escape(new)):
            load_recipe(recipe, [old] if where == "set" else [])
        return
    if where == "env":  # a deployment's environment: the service refuses to start
        monkeypatch.setenv(old, "1")
        with pytest.raises(ValueError, match=re.escape(new)):
            settings_class(service)(model_path="m")
        return
    with pytest.raises(ValueError, match=re.escape(new)):
        settings_class(service)(model_path="m", **{old: 8})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["inference.quantize_router=true"], "quantize_router needs a quantization"),
        (["inference.quantize_activations=true"], "quantize_activations needs a quantization"),
        (["inference.quantization=int8"], "quantization"),
    ],
)
def test_quantization_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(ROOT / "configs" / "tiny-arith.toml", overrides)
    from services.inference.server import engine_options
    from steadyrl.service_settings import build_settings

    for fmt in ("fp8", "fp4"):
        fine = load_recipe(
            ROOT / "configs" / "tiny-arith.toml",
            [f"inference.quantization={fmt}", "inference.quantize_router=true", "inference.quantize_activations=true"],
        )
        settings = build_settings("inference", service_env(fine, "inference", REQUIRED["inference"]))
        assert settings.quantization == fmt and settings.quantize_router and settings.quantize_activations
        options = engine_options(settings)
        assert {k: options[k] for k in ("quantization", "quantize_router", "quantize_activations")} == {
            "quantization": fmt,
            "quantize_router": True,
            "quantize_activations": True,
        }


def test_the_papers_geometry_keeps_the_mini_batch_and_grows_the_global_batch():
    base = ROOT / "configs" / "tiny-arith.toml"
    for n in (1, 2, 4):
        config = load_recipe(base, ["run.mini_batch_prompts=8", f"trainer.mini_batches={n}"])
        assert config.run.batch_prompts == 8 * n  # B = N × mini-batch, replacing the recipe's 32
        trainer = service_env(config, "trainer", REQUIRED["trainer"])
        assert trainer["STEADYRL_TRAINER_BATCH_PROMPTS"] == str(8 * n)
        assert "mini_batch_prompts = 8" in config.as_toml() and f"batch_prompts = {8 * n}" in config.as_toml()
    assert load_recipe(base, ["trainer.mini_batches=4"]).run.batch_prompts == 32  # fixed global batch: N splits it
    with pytest.raises(ValueError, match="mini_batches must be an integer"):
        load_recipe(base, ["run.mini_batch_prompts=8", "trainer.mini_batches=0"])


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_quantized_vllm_without_a_gpu_is_refused_before_anything_starts(monkeypatch, fmt):
    from steadyrl.service_settings import check

    monkeypatch.setattr("shared.engines.vllm_unavailable", lambda: None)
    config = load_recipe(ROOT / "configs" / "tiny-arith-vllm-cpu.toml", [f"inference.quantization={fmt}"])
    with pytest.raises(ValueError, match=f'quantization = "{fmt}" on the vllm engine needs a GPU'):
        check(config, gpus_available=0)
    assert (
        check(load_recipe(ROOT / "configs" / "tiny-arith-vllm-cpu.toml"), gpus_available=0)["inference"].engine
        == "vllm"
    )


def test_recipes_merge_left_to_right(tmp_path):
    from steadyrl.recipe import merge_tables

    assert merge_tables({"a": {"x": 1, "y": {"z": 2}}, "b": 1}, {"a": {"y": {"w": 3}}, "b": 2}) == {
        "a": {"x": 1, "y": {"z": 2, "w": 3}},
        "b": 2,
    }
    gpu = tmp_path / "more.toml"
    gpu.write_text("[run]\nsteps = 7\n\n[trainer.optim]\nlr = 5e-4\n\n[trainer.loss]\neps_high = 0.3\n")
    config = load_recipe([ROOT / "configs" / "tiny-arith.toml", gpu], ["trainer.loss.eps_low=0.1"])
    assert config.steps == 7 and config.run.batch_prompts == 32  # the later file's keys win, the rest stays
    assert config.section("trainer")["optim"]["lr"] == 5e-4 and config.section("trainer")["checkpoint"]["every"] == 10
    assert config.section("trainer")["loss"] == {"eps_high": 0.3, "eps_low": 0.1}
    with pytest.raises(ValueError, match="does not exist"):
        load_recipe([ROOT / "configs" / "tiny-arith.toml", tmp_path / "missing.toml"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_recipe([bad])


@pytest.mark.process  # starts a steadyrl process: not in the fast tier
def test_dry_run_prints_what_each_service_would_read_and_starts_nothing(tmp_path):
    import json
    import subprocess
    import sys

    extra = tmp_path / "extra.toml"
    extra.write_text("[inference.tasks]\nmax_inflight = 4\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadyrl.cli",
            "run",
            str(ROOT / "configs" / "tiny-arith.toml"),
            str(extra),
            "--set",
            "trainer.optim.lr=3e-4",
            "--dry-run",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    shown = json.loads(done.stdout)
    settings = shown["settings"]
    assert settings["trainer"]["optim"]["lr"] == 3e-4 and settings["inference"]["tasks"]["max_inflight"] == 4
    assert settings["trainer"]["batch_prompts"] == settings["orchestrator"]["batch_prompts"] == 32
    assert settings["trainer"]["redis_url"] == "**********" and settings["orchestrator"]["token"] is None
    assert shown["placement"] == {"trainer_gpus": [], "trainer_ranks": 1, "replica_gpus": [[]], "pool_gpus": {}}
    assert "steadyrl plan --model-config" in shown["plan"]["skipped"]  # "tiny" is built at start, not here
    assert "max_inflight = 4" in shown["recipe"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.parametrize(
    "reward, message",
    [
        ("tests.rewards:nope", "cannot be imported"),
        ("tests.rewards:explode", "failed its dry call on one example: error:RuntimeError"),
        ("os.path:join", "failed its dry call on one example: error:ValueError"),  # returns no number
        ("no_such_reward", "no reward named"),
    ],
)
def test_a_reward_that_cannot_serve_is_refused_before_the_run_starts(reward, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(ROOT / "configs" / "tiny-arith.toml", [f"orchestrator.reward={reward}"])


def test_a_reward_with_the_wrong_signature_or_a_hang_is_refused():
    from shared.tasks.reward_runner import check_reward

    with pytest.raises(ValueError, match=r"must take \(completion, answer\)"):
        check_reward("tests.rewards:one_arg", "0", "0")
    with pytest.raises(ValueError, match="dry call on one example: timeout"):
        check_reward("tests.rewards:hang", "0", "0", timeout=1.0)
    assert check_reward("tests.rewards:length", "abc", "0") == 3.0
    config = load_recipe(ROOT / "configs" / "tiny-arith.toml", ["orchestrator.reward=tests.rewards:length"])
    validate("orchestrator", service_env(config, "orchestrator", REQUIRED["orchestrator"]))


@pytest.mark.parametrize("faster", ["float32", "bfloat16"])
def test_an_open_inference_dtype_is_the_faster_one_measured_and_every_service_reads_it(tmp_path, monkeypatch, faster):
    """inference.dtype left open ("auto"): bfloat16 on a GPU replica; on the CPU the dtype whose
    model-shaped matmul measured faster — here a measurement given to the rule, each dtype the faster
    in turn — the same for the replicas and the trainer's publish, and named with its timings in
    config.resolved.toml."""
    from shared.engines import dtype_choice
    from steadyrl.service_settings import settle_auto_dtype

    slower = "bfloat16" if faster == "float32" else "float32"
    asked = []

    def measured(width: int, threads: int = 1) -> dict[str, float]:
        asked.append((width, threads))
        return {"float32": 2e-3, "bfloat16": 3e-3} if faster == "float32" else {"float32": 3e-3, "bfloat16": 2e-3}

    monkeypatch.setattr(dtype_choice, "matmul_seconds", measured)
    assert dtype_choice.choose_dtype(1) == ("bfloat16", "a GPU replica serves bfloat16") and not asked
    dtype, why = dtype_choice.choose_dtype(0)
    assert dtype == faster and asked == [(1024, 1)]  # the model's width (1,024 when unknown), one thread
    assert f"{faster} 2.000 ms" in why and f"{slower} 3.000 ms" in why
    recipe = tmp_path / "open.toml"
    recipe.write_text((ROOT / "configs" / "tiny-arith.toml").read_text().replace('dtype = "bfloat16"\n', ""))
    config = load_recipe(recipe)
    assert "dtype" not in config.section("inference")
    inference = service_env(config, "inference", REQUIRED["inference"])
    trainer = service_env(config, "trainer", REQUIRED["trainer"])
    assert inference["STEADYRL_INFERENCE_DTYPE"] == trainer["STEADYRL_TRAINER_PUBLISH__DTYPE"] == faster
    config = settle_auto_dtype(config, "tiny")
    assert config.section("inference")["dtype"] == faster
    assert config.as_toml().startswith(f'# inference.dtype "auto" chose "{faster}": the faster on this CPU')
    named = load_recipe(ROOT / "configs" / "tiny-arith.toml")  # a recipe that names its dtype keeps it
    calls = len(asked)
    named = settle_auto_dtype(named, "tiny")
    assert named.section("inference")["dtype"] == "bfloat16" and not named.notes and len(asked) == calls


def test_the_dtype_measurement_times_both_dtypes_on_the_model_s_shape():
    """What the rule above is given: the best of its rounds per dtype, each a real matmul's seconds."""
    from shared.engines.dtype_choice import matmul_seconds

    seconds = matmul_seconds.__wrapped__(64, 1, rows=8, rounds=2)
    assert set(seconds) == {"float32", "bfloat16"} and all(0 < s < float("inf") for s in seconds.values())


def test_the_moved_names_table_ends_at_its_stated_version():
    """The table of old flat names is kept only until the version the reference page states: a
    release at or past it still carrying the table fails here."""
    from importlib.metadata import version

    from packaging.version import Version

    from shared.runtime.moved_settings import MOVED, REMOVED_IN

    assert MOVED and Version(version("steadyrl")) < Version(REMOVED_IN), (
        f"steadyrl {version('steadyrl')} is at or past {REMOVED_IN}: remove shared/runtime/moved_settings.py"
    )
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    assert f"until version {REMOVED_IN}" in page and "| `trainer.lr` | `trainer.optim.lr` |" in page


@pytest.mark.parametrize(
    "override",
    [
        "trainer.optim.lr=inf",
        "trainer.optim.lr=1e400",
        "trainer.optim.grad_clip=inf",
        "trainer.optim.adam_betas=[nan, 0.9]",
        "trainer.loss.eps_high=inf",
        "trainer.stall_alert_seconds=inf",
        "run.restart_backoff_seconds=inf",
        "orchestrator.stop.stalled_seconds=inf",
        "inference.tasks.lease_seconds=nan",
        "weightsync.collective_timeout_seconds=inf",
    ],
)
def test_no_setting_takes_an_infinite_or_nan_number(override):
    """An infinite backoff waited forever after a crash, an infinite learning rate dead-lettered every
    task: every float of a recipe is finite, nested ones and [run]'s too."""
    with pytest.raises(ValueError, match="finite number"):
        load_recipe(ROOT / "configs" / "tiny-arith.toml", [override])


def test_adam_betas_lie_in_the_unit_interval():
    with pytest.raises(ValueError, match=r"adam_betas must each lie in \[0, 1\)"):
        load_recipe(ROOT / "configs" / "tiny-arith.toml", ["trainer.optim.adam_betas=[0.9, 1.5]"])
    recipe = load_recipe(ROOT / "configs" / "tiny-arith.toml", ["trainer.optim.adam_betas=[0.9, 0.95]"])
    assert recipe.trainer.optim.adam_betas == (0.9, 0.95)


@pytest.mark.parametrize(
    "override, message",
    [
        ('orchestrator.token="TOKSECRET123"', r"\[orchestrator\] token is a secret"),
        ('trainer.redis_url="redis://:HUNTER2SECRET@127.0.0.1:6379/0"', r"\[trainer\] redis_url carries a password"),
        ("orchestrator.redis_url=[1, 'HUNTER2SECRET']", r"redis_url\s+Input should be a valid string"),
        ('inference.redis_url="redis://127.0.0.1:6379/0?password=HUNTER2SECRET"', "redis_url carries a password"),
        ('inference.redis_url="redis://HUNTER2SECRET@127.0.0.1:6379/0"', "redis_url carries a password"),
        ('trainer.redis_url="redis://127.0.0.1:notaportSECRET/0"', "redis_url is not a Redis URL"),
        ("weightsync.redis_url=HUNTER2SECRET", "redis_url is not a Redis URL"),
    ],
)
def test_a_recipe_carries_no_secret_and_an_error_never_echoes_one(override, message):
    """A recipe is copied into every run directory and printed by --dry-run: a token or a Redis password in
    it is refused, and no error message repeats what it was given for a service's setting."""
    with pytest.raises(ValueError, match=message) as refused:
        load_recipe(ROOT / "configs" / "tiny-arith.toml", [override])
    assert "SECRET" not in str(refused.value)
    plain = load_recipe(ROOT / "configs" / "tiny-arith.toml", ['trainer.redis_url="redis://127.0.0.1:6379/0"'])
    assert plain.trainer.redis_url.get_secret_value() == "redis://127.0.0.1:6379/0"  # no password: not a secret


def test_what_steadyrl_run_places_over_a_recipe_s_value_is_said(tmp_path):
    """A recipe's trainer.host or port is a deployment's; `steadyrl run` places its own on this host and
    names each one it placed over (it used to show the recipe's in config.resolved.toml and bind its own)."""
    from steadyrl.processes import Launch

    recipe = load_recipe(ROOT / "configs" / "tiny-arith.toml", ['trainer.host="0.0.0.0"', "trainer.port=6379"])
    launch = Launch(recipe, tmp_path / "run", "model")
    launch.plan("redis://127.0.0.1:6379/0")
    assert launch.placed_over == ["trainer.host", "trainer.port"]
    trainer = next(s for s in launch.services if s.name == "trainer")
    assert trainer.env["STEADYRL_TRAINER_HOST"] == "127.0.0.1" and trainer.env["STEADYRL_TRAINER_PORT"] != "6379"
    plain = Launch(load_recipe(ROOT / "configs" / "tiny-arith.toml"), tmp_path / "plain", "model")
    plain.plan("redis://127.0.0.1:6379/0")
    assert plain.placed_over == []


def test_a_service_section_cannot_set_the_model_and_a_huge_name_is_not_repeated():
    """[model] declares the path for every service as [run] declares B and G (a service's model_path was
    silently replaced by model.path); a --set name of 100,000 characters is refused without its whole text."""
    with pytest.raises(ValueError, match=r"\[orchestrator\] sets model_path, which \[model\] declares"):
        load_recipe(ROOT / "configs" / "tiny-arith.toml", ['orchestrator.model_path="foo"'])
    for override in ("nosuchsection." + "A" * 100_000 + "=1", "trainer." + "k" * 100_000 + "=1"):
        with pytest.raises(ValueError, match=r"--set names a setting of 1000\d\d characters") as refused:
            load_recipe(ROOT / "configs" / "tiny-arith.toml", [override])
        assert len(str(refused.value)) < 300
