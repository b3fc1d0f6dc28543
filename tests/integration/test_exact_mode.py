"""Exact mode end to end: a live replica (real redis-server, weight-sync and gRPC) samples groups of
ragged prompts and budgets with continuous batching at changing batch sizes while a trained version
lands in flight; the trainer trains those rollouts in exact mode, and every token's sampling logprob
equals the trainer's recompute under the version that sampled it, bit for bit. With exact mode off,
the same scenario fails the same assertions."""

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from redis.asyncio import Redis

from services.trainer.batch import collate
from services.trainer.config import TrainerSettings
from services.trainer.forward import sequence_logprobs
from services.trainer.model_runner import StepRunner
from shared.engines import make_engine
from shared.models import batch_invariant, load_causal_lm
from shared.models.routing import RoutingController
from shared.rollouts.record import decode_rollout
from shared.rpc.steadyrl.v1 import common_pb2
from shared.runstore.queues import WorkQueue
from shared.weightsync.grpc import GrpcWeightPublisher
from tests.helpers import submit
from tests.integration.test_inference import Replica, _version_is, prompts_of, wait_for

GROUP = 4
BUDGETS = {"short": 3, "long": 40, "mid": 9, "late": 14}  # max_new_tokens of each group


@dataclass
class Outcome:
    tokens: int = 0
    differing: int = 0  # tokens whose sampling logprob is not the trainer's recompute, bit for bit
    routes: int = 0  # (position, layer) pairs of the replica's traces
    routes_differing: int = 0
    long_versions: list[set[int]] = field(default_factory=list)  # versions in each long rollout
    batch_sizes: set = field(default_factory=set)  # rows of the engine's decode steps, "+n" its prefills
    first: dict = field(default_factory=dict)  # the step on the short group (version 0)
    second: dict = field(default_factory=dict)  # the step on the others (version 1)


def task(name: str, prompt: list[int]) -> common_pb2.PromptTask:
    budget = BUDGETS[name]
    return common_pb2.PromptTask(
        task_id=name,
        task_name="exact_match",
        prompt_token_ids=prompt,
        answer="0",
        group_size=GROUP,
        sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=budget, seed=5, ignore_eos=name == "long"),
    )


def observed(engine, sizes: set[int]):
    """The engine's forwards, each recording its batch size (a decode step's rows, "+n" for a prefill
    of n newcomers), a decode step taking 10 ms more (so the long group is still generating when the
    next version lands); the numbers are untouched."""
    decode, admit = engine._decode, engine._admit

    def step():
        sizes.add(len(engine._live))
        time.sleep(0.01)
        decode()

    def admitted(seqs, tokens=None):
        sizes.add(f"+{len(seqs)}")
        admit(seqs, tokens)

    engine._decode, engine._admit = step, admitted


def trainer(tmp_path, model_dir, redis_url, run_id, exact: bool) -> StepRunner:
    return StepRunner(
        TrainerSettings(
            model_path=str(model_dir),
            out_dir=tmp_path / "trainer",
            redis_url=redis_url,
            run_id=run_id,
            batch_prompts=1,
            group_size=GROUP,
            max_staleness=1,
            exact=exact,
            optim={"lr": 1e-2},  # a version that moves the logprobs
            compute={"torch_threads": 1},
            publish={"dtype": "float32"},
        )
    )


def by_group(rollouts) -> list:
    return sorted(rollouts, key=lambda r: (r.task_id, int(r.rollout_id.rsplit(":", 1)[1])))


def scenario(tmp_path, model_dir, redis_url: str, run_id: str, exact: bool) -> Outcome:
    out = Outcome()
    engine = make_engine("torch", str(model_dir), "float32", threads=1, max_num_seqs=6, exact=exact)
    observed(engine, out.batch_sizes)
    runner = trainer(tmp_path, model_dir, redis_url, run_id, exact)
    weights = {0: {k: v.detach().clone() for k, v in runner.model.state_dict().items()}}
    prompts = prompts_of(4, seed=9)
    prompts[1], prompts[3] = prompts[1][2:], prompts[3][1:]  # ragged: left padding in the engine

    async def main():
        redis = Redis.from_url(redis_url)
        queue = WorkQueue(redis, run_id)
        replica = Replica(
            tmp_path,
            model_dir,
            redis_url,
            run_id,
            engine=engine,
            exact=exact,
            torch_threads=1,
            max_num_seqs=6,
            tasks={"max_inflight": 4},
        )
        async with replica:
            publisher = GrpcWeightPublisher(f"127.0.0.1:{replica.ws_port}", replica.signer)
            for name, prompt in zip(BUDGETS, prompts, strict=True):
                await submit(queue, task(name, prompt))
            await wait_for(lambda: _completed(queue, 1))  # the short group: trained while the others generate
            short = by_group([decode_rollout(f[b"r"]) for _, f in await redis.xrange(queue.rollout_stream)])
            for i, rollout in enumerate(short):  # rewards that differ: an update that moves the weights
                rollout.reward = float(i % 2)
            out.first = await asyncio.to_thread(runner.step, short, 0)
            weights[1] = {k: v.detach().clone() for k, v in runner.model.state_dict().items()}
            await publisher.push(dict(runner.weights()), 1)  # lands in flight: the long group is mid-way
            await wait_for(lambda: _version_is(replica.stub, 1))
            await wait_for(lambda: _completed(queue, len(BUDGETS)))
            entries = await redis.xrange(queue.rollout_stream)
            await publisher.close()
        await redis.aclose()
        return [decode_rollout(f[b"r"]) for _, f in entries]

    rollouts = asyncio.run(asyncio.wait_for(main(), 180))
    rest = by_group([r for r in rollouts if r.task_id != "short"])
    out.long_versions = [set(r.policy_versions.tolist()) for r in rest if r.task_id == "long"]
    out.second = runner.step(rest, 1)
    compare(out, model_dir, by_group(rollouts), weights, runner, exact)
    engine.close()
    return out


def compare(out: Outcome, model_dir, rollouts, weights, runner: StepRunner, exact: bool) -> None:
    """Every token against the trainer's forward (its own function, settings and batch layout)
    under the version that sampled it; every trace against the routing that version computes."""
    model = load_causal_lm(model_dir, "float32")
    if exact:
        batch_invariant.prepare(model)
    routing = RoutingController(model)
    batch = collate(rollouts, runner.pad_token_id)
    last = torch.tensor([int(r.policy_versions[-1]) for r in rollouts])  # a trace is its last version's
    for version, state in weights.items():
        model.load_state_dict(state)
        with torch.no_grad():
            forward = sequence_logprobs(model, batch, routing, capture=True, compute=runner.compute)
        sampled_by = batch.loss_mask & (batch.versions == version)
        out.tokens += int(sampled_by.sum())
        out.differing += int((sampled_by & (forward.logprobs != batch.inference_logprobs)).sum())
        traced = batch.trace_mask & (last == version)[:, None]
        same = (forward.routing.sort(-1).values == batch.trace.sort(-1).values).all(-1)  # [B, S, layers]
        out.routes += int(traced.sum()) * same.shape[-1]
        out.routes_differing += int((~same & traced[..., None]).sum())
    routing.close()


async def _completed(queue: WorkQueue, count: int) -> bool:
    return (await queue.depths()).completed >= count


def assert_exact(out: Outcome) -> None:
    assert out.differing == 0, f"{out.differing} of {out.tokens} tokens differ from the trainer's recompute"
    assert out.routes_differing == 0, f"{out.routes_differing} of {out.routes} routed experts differ"
    first, second = out.first, out.second
    for step in (first, second):
        assert step["exact_tokens"] == step["tokens"] and step["exact_unchecked_tokens"] == 0
    # the first step, all at staleness 0: no mismatch, every IS weight exactly 1, the routing agreed
    assert first["mismatch_kl_k1"] == 0.0 and first["mismatch_kl_k3"] == 0.0
    assert first["is_weight_mean"] == 1.0 and first["is_weight_max"] == 1.0 and first["is_identity"] == 1.0
    assert first["routing_agreement"] == 1.0
    # the second: its own version's tokens the same; the older ones differ by their staleness alone
    assert second["mismatch_kl_k3_s0"] == 0.0 and second["is_weight_mean_s0"] == 1.0
    assert second["staleness_tokens_s1"] > 0 and second["mismatch_kl_k3_s1"] > 0 and second["is_identity"] == 0.0


def test_exact_mode_every_token_bit_for_bit(tmp_path, tiny_model_dir, redis_server, run_id):
    out = scenario(tmp_path, tiny_model_dir, redis_server.url, run_id, exact=True)
    print(
        f"exact: {out.tokens} tokens, {out.differing} differ; {out.routes} routes, {out.routes_differing} differ; "
        f"batch sizes {sorted(map(str, out.batch_sizes))}; long rollouts' versions {out.long_versions}"
    )
    assert out.tokens == out.first["tokens"] + out.second["tokens"] >= 160
    assert all(versions == {0, 1} for versions in out.long_versions) and len(out.long_versions) == GROUP
    decodes = {size for size in out.batch_sizes if isinstance(size, int)}
    assert len(out.batch_sizes) >= 3 and len(decodes) >= 2 and max(decodes) <= 6, out.batch_sizes
    assert_exact(out)


def test_the_same_scenario_fails_with_exact_mode_off(tmp_path, tiny_model_dir, redis_server, run_id):
    out = scenario(tmp_path, tiny_model_dir, redis_server.url, run_id, exact=False)
    print(f"normal: {out.tokens} tokens, {out.differing} differ from the trainer's recompute")
    assert all(versions == {0, 1} for versions in out.long_versions)
    with pytest.raises(AssertionError, match="tokens differ"):
        assert_exact(out)
    assert out.differing > out.tokens // 10


def test_a_wrong_sampled_logprob_stops_the_step_naming_the_token(tmp_path, tiny_model_dir, redis_server, run_id):
    """One bit off in one token's sampling logprob: the exact step raises, naming that token (an
    older version's token too, checked under that version's kept weights)."""
    from services.trainer.global_step import ExactMismatch
    from shared.engines import Sampling
    from shared.rollouts.record import RolloutTimings
    from shared.rollouts.samples import rollouts_from_samples

    engine = make_engine("torch", str(tiny_model_dir), "float32", threads=1, exact=True)
    [prompt] = prompts_of(1, seed=2)
    samples = engine.generate([prompt] * GROUP, Sampling(temperature=1.0, max_new_tokens=6, seed=3))
    engine.close()

    def group(task_id: str):
        task = common_pb2.PromptTask(task_id=task_id, run_id=run_id, prompt_token_ids=prompt)
        return rollouts_from_samples(task, samples, [0.0, 1.0, 0.0, 1.0], "r", "torch", RolloutTimings())

    runner = trainer(tmp_path, tiny_model_dir, redis_server.url, run_id, exact=True)
    metrics = runner.step(group("a"), 0)
    assert metrics["exact_tokens"] == metrics["tokens"] > 0 and metrics["is_identity"] == 1.0
    bad = group("b")
    logprobs = bad[2].inference_logprobs
    logprobs.view(np.int32)[3] += 1  # the next float32 down: one bit
    with pytest.raises(ExactMismatch, match=r"rollout b:2 completion token 3 \(id \d+, version 0\)"):
        runner.step(bad, 1)


def test_a_step_with_a_token_that_differs_is_not_applied_and_its_rollouts_are_dead_lettered(
    tmp_path, tiny_model_dir, redis_server, run_id
):
    """In the trainer's loop: a batch holding one forged bit is not applied (no step, no version), its
    rollouts dead-lettered as exact_mismatch naming the token, counted; the next batch trains."""
    from prometheus_client import REGISTRY

    from shared.engines import Sampling
    from shared.rollouts.record import RolloutTimings
    from shared.rollouts.samples import rollouts_from_samples
    from tests.integration.test_trainer import trainer_holding

    engine = make_engine("torch", str(tiny_model_dir), "float32", threads=1, exact=True)
    prompts = prompts_of(4, seed=6)
    samples = engine.generate(
        [p for p in prompts for _ in range(GROUP)], Sampling(temperature=1.0, max_new_tokens=5, seed=2)
    )
    engine.close()
    rollouts = []
    for g, prompt in enumerate(prompts):
        task = common_pb2.PromptTask(task_id=f"g{g}", run_id=run_id, prompt_token_ids=prompt)
        mine = samples[g * GROUP : (g + 1) * GROUP]
        rollouts += rollouts_from_samples(task, mine, [0.0, 1.0, 0.0, 1.0], "r", "torch", RolloutTimings())
    rollouts[1].inference_logprobs.view(np.int32)[0] += 1  # group g0, sample 1, its first token: one bit

    def counted() -> float:
        return REGISTRY.get_sample_value("steadyrl_trainer_exact_mismatch_steps_total") or 0.0

    async def main():
        exact = {
            "exact": True,
            "batch_prompts": 2,
            "group_size": GROUP,
            "compute": {"torch_threads": 1},
            "publish": {"dtype": "float32"},
        }
        redis, trainer = await trainer_holding(tmp_path, tiny_model_dir, redis_server, run_id, rollouts, **exact)
        before = counted()
        first = await trainer.step(["g0", "g1"])
        after_bad = (trainer.state.step, trainer.state.version, counted() - before)
        dead = await redis.xrange(trainer.source.keys.rollouts_dead)
        second = await trainer.step(["g2", "g3"])
        await trainer.close()
        await redis.aclose()
        return first, after_bad, dead, second

    first, after_bad, dead, second = asyncio.run(asyncio.wait_for(main(), 120))
    assert first == {"exact_mismatch": 1.0} and after_bad == (0, 0, 1.0)
    assert len(dead) == 2 * GROUP and {f[b"reason"] for _, f in dead} == {b"exact_mismatch"}
    message = dead[0][1][b"message"].decode()
    assert message.startswith("step not applied: exact mode: rollout g0:1 completion token 0 (id ")
    assert second["step"] == 1 and second["exact_tokens"] == second["tokens"] > 0


def test_after_a_restart_tokens_of_versions_it_never_held_are_dropped_not_trained_unchecked(
    tmp_path, tiny_model_dir, redis_server, run_id
):
    """Exact mode: a trainer started at version v (a restart: the weights of the versions before are
    gone) drops, as stale, the groups holding a token of a version before v instead of training
    them unchecked; a trainer not in exact mode keeps them (within the staleness budget)."""
    from shared.engines import Sampling
    from shared.rollouts.record import RolloutTimings
    from shared.rollouts.samples import rollouts_from_samples
    from tests.integration.test_trainer import trainer_holding

    engine = make_engine("torch", str(tiny_model_dir), "float32", threads=1, exact=True)
    [prompt] = prompts_of(1, seed=8)
    samples = engine.generate([prompt] * GROUP, Sampling(temperature=1.0, max_new_tokens=4, seed=2))
    engine.close()
    task = common_pb2.PromptTask(task_id="old", run_id=run_id, prompt_token_ids=prompt)
    rollouts = rollouts_from_samples(task, samples, [0.0, 1.0, 0.0, 1.0], "r", "torch", RolloutTimings())

    async def held_after_start(exact: bool, index: int) -> tuple[int, int]:
        settings = {"exact": exact, "group_size": GROUP, "compute": {"torch_threads": 1}}
        settings["publish"] = {"dtype": "float32"}
        redis, trainer = await trainer_holding(
            tmp_path / str(index), tiny_model_dir, redis_server, f"{run_id}{index}", rollouts, **settings
        )
        trainer.state.version = 1  # restarted from a checkpoint of version 1: version 0's weights are gone
        await trainer.start(asyncio.Event())
        await trainer.intake.drop_stale(trainer.settings.max_staleness)
        held = (trainer.buffer.held, trainer.intake.oldest_checkable)
        await trainer.close()
        await redis.aclose()
        return held

    exact = asyncio.run(asyncio.wait_for(held_after_start(True, 0), 120))
    normal = asyncio.run(asyncio.wait_for(held_after_start(False, 1), 120))
    assert exact == (0, 1) and normal == (GROUP, 0)
