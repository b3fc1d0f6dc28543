"""run.exact's rules, refused before any process starts, each naming what exact mode needs; the
replicas' dtype "auto" resolves to the trainer's float32; the torch engine refuses what it cannot
compute exactly."""

from pathlib import Path

import pytest

from steadyrl.recipe import load_recipe

EXACT = Path(__file__).resolve().parents[2] / "configs" / "tiny-arith-exact.toml"


def test_the_exact_demo_types_with_both_sides_exact_in_float32():
    config = load_recipe(EXACT, ["inference.dtype=auto"])
    assert config.run.exact and config.trainer.exact and config.inference.exact
    assert config.inference.dtype == "float32" and config.trainer.publish.dtype == "float32"
    assert config.trainer.step_config("off", True).exact


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("inference.dtype=bfloat16", "run.exact needs inference.dtype = 'float32'"),
        ("inference.engine=vllm", "inference.engine = 'torch'"),
        ("inference.torch_threads=2", "inference.torch_threads = 1"),
        ("inference.quantization=fp8", "inference.quantization = 'none'"),
        ("trainer.compute.torch_threads=0", "trainer.compute.torch_threads = 1"),
        ("trainer.compute.precision=bf16-mixed", "trainer.compute.precision = 'fp32'"),
        ("trainer.compute.activation_checkpointing=true", "activation_checkpointing = false"),
        ("trainer.publish.dtype=bfloat16", "trainer.publish.dtype = 'float32'"),
        ("trainer.lora.rank=4", "no trainer.lora"),
        ("trainer.parallel.ranks=2", "one trainer rank"),
        ("orchestrator.sampling.temperature=0.7", "temperature 1 (or 0) and top_p 1"),
        ("orchestrator.sampling.top_p=0.9", "temperature 1 (or 0) and top_p 1"),
    ],
)
def test_what_exact_mode_cannot_compute_is_refused_before_start(setting, named):
    with pytest.raises(ValueError, match="run.exact") as refused:
        load_recipe(EXACT, [setting])
    assert named in str(refused.value)


def test_a_trainer_and_replicas_on_different_devices_are_refused():
    with pytest.raises(ValueError, match="one kind of device"):
        load_recipe(EXACT, ["trainer.parallel.gpus=1"])
    with pytest.raises(ValueError, match="one kind of device"):
        load_recipe(EXACT, ["inference.gpus_per_replica=1"])


def test_another_recipe_turns_exact_on_once_its_replicas_compute_in_float32():
    demo = EXACT.with_name("tiny-arith.toml")
    with pytest.raises(ValueError, match="run.exact needs inference.dtype = 'float32'"):
        load_recipe(demo, ["run.exact=true"])
    config = load_recipe(demo, ["run.exact=true", "inference.dtype=float32"])
    assert config.trainer.exact and config.inference.exact
    # an alias of inference.dtype reaches the trainer's publishing by its full name
    assert load_recipe(demo, ["inference.dtype=bf16"]).trainer.publish.dtype == "bfloat16"


def test_sampled_evals_at_another_temperature_are_refused():
    with pytest.raises(ValueError, match=r"run.exact: the replicas sample at temperature 1 only"):
        load_recipe(EXACT, ["orchestrator.evals.samples=2", "orchestrator.evals.temperature=0.5"])
    assert load_recipe(EXACT, ["orchestrator.evals.samples=2"]).orchestrator.evals.samples == 2


def test_the_engine_refuses_what_it_cannot_compute_exactly(tiny_model_dir):
    from shared.engines import Sampling, make_engine

    with pytest.raises(ValueError, match="dtype float32 and no quantization"):
        make_engine("torch", str(tiny_model_dir), "bfloat16", exact=True)
    engine = make_engine("torch", str(tiny_model_dir), "float32", threads=1, exact=True)
    try:
        assert "exact: batch-invariant forwards" in engine.capabilities.notes
        with pytest.raises(ValueError, match="temperature 1, or 0 for greedy"):
            engine.start([5, 6, 7], Sampling(temperature=0.7, max_new_tokens=2))
        with pytest.raises(ValueError, match="no top-k or top-p"):
            engine.start([5, 6, 7], Sampling(temperature=1.0, top_p=0.5, max_new_tokens=2))
        # a leased task asking for it is unservable at once (dead-lettered with the reason, never retried)
        from services.inference.leased_work import Unservable, check_lease
        from shared.rpc.steadyrl.v1 import common_pb2
        from shared.runstore.queues import Lease
        from shared.tasks.reward_runner import RewardRunner

        task = common_pb2.PromptTask(
            task_id="t", task_name="exact_match", prompt_token_ids=[5, 6, 7], group_size=2,
            sampling=common_pb2.SamplingParams(temperature=0.7, max_new_tokens=2),
        )  # fmt: skip
        with pytest.raises(Unservable, match="exact mode samples the model's own distribution") as unservable:
            check_lease(Lease("t", task, 0), "", engine, None, RewardRunner())
        assert unservable.value.code == "sampling"
        [greedy] = engine.generate([[5, 6, 7]], Sampling(temperature=0.0, max_new_tokens=3))
        assert len(greedy.token_ids) >= 1 and all(lp <= 0 for lp in greedy.logprobs)
    finally:
        engine.close()
