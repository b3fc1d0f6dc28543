"""The trainer on the tiny MoE: real redis-server, recorded rollouts from the bf16 torch engine."""

import asyncio
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from services.trainer.batch import collate
from services.trainer.checkpoint import load_model_weights
from services.trainer.config import TrainerSettings
from services.trainer.forward import sequence_logprobs
from services.trainer.global_step import StepConfig, train_step
from services.trainer.server import serve as serve_trainer
from shared.core.loss import LossConfig, policy_loss
from shared.engines import Sampling, make_engine
from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts
from shared.models import load_causal_lm
from shared.models.routing import RoutingController
from shared.rollouts.record import RolloutTimings, decode_rollout
from shared.rollouts.samples import rollouts_from_samples
from shared.rpc.steadyrl.v1 import common_pb2
from shared.runstore.queues import WorkQueue
from shared.tasks import get_reward
from steadyrl.recipe import merge_tables
from tests.helpers import publish

GROUP = 4
REASONS = (
    "decode",
    "missing_field",
    "future_version",
    "nonfinite_logprobs",
    "expert_range",
    "trace_shape",
    "length",
    "oversize",
)


def recorded_rollouts(model_dir, groups: int, seed: int = 0, version: int = 0):
    """`groups` prompts × G samples from the bf16 torch engine, scored, as Rollouts."""
    engine = make_engine("torch", str(model_dir), "bfloat16")
    tokenizer = char_tokenizer()
    examples = TinySpec().task(seed).split("train", groups)
    prompts = encode_prompts(tokenizer, [e.prompt for e in examples])
    samples = engine.generate(
        [p for p in prompts for _ in range(GROUP)],
        Sampling(temperature=1.0, max_new_tokens=6, seed=seed + 1),
        return_trace=True,
    )
    out = []
    for g, (example, prompt) in enumerate(zip(examples, prompts, strict=True)):
        mine = samples[g * GROUP : (g + 1) * GROUP]
        for s in mine:
            s.versions = [version] * len(s.token_ids)
        task = common_pb2.PromptTask(task_id=f"s{seed}-t{g}", run_id="r", prompt_token_ids=prompt)
        rewards = [
            get_reward("exact_match")(tokenizer.decode(s.token_ids, skip_special_tokens=True), example.answer)
            for s in mine
        ]
        out.extend(rollouts_from_samples(task, mine, rewards, "rec", "torch", RolloutTimings()))
    return out


def settings_for(tmp_path, model_dir, redis_server, run_id, **overrides) -> TrainerSettings:
    values = dict(
        port=0,
        metrics_port=0,
        model_path=str(model_dir),
        out_dir=tmp_path / "trainer",
        redis_url=redis_server.url,
        run_id=run_id,
        batch_prompts=2,
        group_size=GROUP,
        optim={"lr": 1e-3},
        stream={"read_block_ms": 50},
    )
    return TrainerSettings(**merge_tables(values, overrides))


def test_one_step_through_redis_equals_the_math_by_hand(tmp_path, tiny_model_dir, redis_server, run_id):
    rollouts = recorded_rollouts(tiny_model_dir, 2)

    async def main():
        redis = Redis.from_url(redis_server.url)
        await publish(redis, run_id, rollouts)
        await publish(redis, run_id, rollouts[:2])  # delivered twice: trained once
        # whole rows, as the math by hand: a shared prefix sums in another order (to 4e-6 after
        # AdamW's first, sign-like step; tests/unit/test_shared_prefix.py holds it to the plain forward)
        compute = {"shared_prefix": False}
        await serve_trainer(settings_for(tmp_path, tiny_model_dir, redis_server, run_id, max_steps=1, compute=compute))
        stream = WorkQueue(redis, run_id).rollout_stream
        pending = await redis.xpending(stream, "trainer")
        ledger = await redis.lrange(stream.rsplit(":", 1)[0] + ":trained", 0, -1)
        await redis.aclose()
        return pending, ledger

    pending, ledger = asyncio.run(asyncio.wait_for(main(), 120))
    assert pending["pending"] == 0  # everything acknowledged: the step is checkpointed
    assert sorted(x.decode() for x in ledger) == sorted(r.rollout_id for r in rollouts)
    # the same step by hand: shared.core on the same batch, AdamW, grad clip 1.0
    model = load_causal_lm(tiny_model_dir, "float32").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    batch = collate(rollouts)
    rewards = batch.rewards.view(-1, GROUP)
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)).reshape(-1)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
        old = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    current = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    loss, _ = policy_loss(current, old, batch.inference_logprobs, advantages, batch.loss_mask, LossConfig())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

    trained = load_model_weights(tmp_path / "trainer" / "checkpoints" / "step-00000001")
    start = load_causal_lm(tiny_model_dir, "float32").state_dict()
    worst = max(float((trained[k] - v).abs().max()) for k, v in model.state_dict().items())
    moved = max(float((trained[k] - v).abs().max()) for k, v in start.items())
    assert worst <= 1e-6 and moved > 1e-4
    line = json.loads((tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()[0])
    for key in (
        "step",
        "version",
        "reward_mean",
        "entropy",
        "mismatch_kl_k1",
        "mismatch_kl_k3",
        "is_weight_mean",
        "is_weight_max",
        "is_truncated_frac",
        "clip_frac",
        "staleness_mean",
        "staleness_peak",
        "dropped_stale",
        "routing_agreement",
        "first_order_error",
        "grad_norm",
        "tokens_per_s",
        "step_seconds",
    ):
        assert key in line, key
    assert line["step"] == 1 and line["version"] == 1 and line["recipe"] == "minirl+tis+clip"
    assert line["mismatch_kl_k3"] > 0 and 0.9 < line["routing_agreement"] <= 1.0  # bf16 inference vs fp32


def forward_snapshots(model, routing):
    """Record, for every forward of `model`, the expert ids it routed by (replay) per layer."""
    seen = []

    def hook(module, args, output):
        if routing.mode == "replay":
            seen.append([t.clone() for t in routing.replayed])

    handle = model.register_forward_hook(hook)
    return seen, handle


def test_r3_routes_every_forward_exactly_as_the_inference_trace(tiny_model_dir):
    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=3)
    rng = np.random.default_rng(0)
    for r in rollouts:  # a trace unlike the model's own routing: replay must follow it
        r.routing_trace = (
            np.stack([rng.permutation(8)[:2] for _ in range(r.routing_trace.shape[0] * 2)])
            .reshape(-1, 2, 2)
            .astype(np.uint8)
        )
    batch = collate(rollouts)
    model = load_causal_lm(tiny_model_dir, "float32").train()
    routing = RoutingController(model)
    seen, handle = forward_snapshots(model, routing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optimizer, routing, batch, GROUP, StepConfig(replay="r3", mini_batches=2), version=0)
    handle.remove()
    assert len(seen) == 3  # π_old recompute + two updates (the agreement capture is not replayed)
    rows = [list(range(0, 4)), list(range(4, 8))]
    for forward, picked in zip(seen, [list(range(8)), *rows], strict=True):
        for layer, used in enumerate(forward):
            used = used.view(len(picked), batch.input_ids.shape[1], 2)
            want = batch.trace[picked][..., layer, :]
            where = batch.trace_mask[picked]
            assert torch.equal(used[where], want[where])


@pytest.mark.parametrize("lora", [False, True])
def test_r2_replays_the_recompute_routing_in_every_update(tiny_model_dir, lora):
    """R2, also under LoRA (attention + experts adapted, the router frozen: the adapter alone moves
    the hidden states the router sees)."""
    from shared.models.lora import apply_lora

    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=5)
    for i, r in enumerate(rollouts):  # rewards that differ within each group: the update moves the model
        r.reward = float(i % 2)
    batch = collate(rollouts)
    model = load_causal_lm(tiny_model_dir, "float32").train()
    if lora:
        model = apply_lora(model, 8, 16.0, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"], True).train()
    routing = RoutingController(model)
    with torch.no_grad():
        expected = sequence_logprobs(model, batch, routing, capture=True).routing
    seen, handle = forward_snapshots(model, routing)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert not lora or all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trained, lr=5e-2)  # large: free routing would drift
    train_step(model, optimizer, routing, batch, GROUP, StepConfig(replay="r2", mini_batches=2), version=0)
    handle.remove()
    assert len(seen) == 2  # the recompute captures; each update replays
    for forward, picked in zip(seen, [list(range(0, 4)), list(range(4, 8))], strict=True):
        where = batch.attention_mask[picked].bool()
        for layer, used in enumerate(forward):
            used = used.view(len(picked), batch.input_ids.shape[1], 2)
            assert torch.equal(used[where], expected[picked][..., layer, :][where])
    with torch.no_grad():  # and without replay the updated model now routes differently somewhere
        free = sequence_logprobs(model, batch, routing, capture=True).routing
    assert not torch.equal(free[batch.attention_mask.bool()], expected[batch.attention_mask.bool()])


@pytest.mark.parametrize("replay", ["off", "r2"])
def test_one_update_takes_pi_old_from_its_own_forward_and_equals_a_separate_pass(tiny_model_dir, replay):
    """N = 1: the update's forward, detached, is log π_old (the model before its one update), and
    R2 would replay what that forward routes: the step without the no-grad pass moves the weights
    and reports the diagnostics (clip fractions, IS weights, routing agreement) as with it."""
    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=5)
    for i, r in enumerate(rollouts):
        r.reward = float(i % 2)
    batch = collate(rollouts)
    results = []
    for separate in (True, False):
        torch.manual_seed(0)
        model = load_causal_lm(tiny_model_dir, "float32").train()
        routing = RoutingController(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
        config = StepConfig(replay=replay, separate_old_pass=separate)
        assert config.fuses_old is not separate
        calls: list[int] = []
        handle = model.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        metrics = train_step(model, optimizer, routing, batch, GROUP, config, version=0)
        handle.remove()
        results.append((metrics, {n: p.detach().clone() for n, p in model.named_parameters()}, len(calls)))
    (separate, weights_a, forwards_a), (fused, weights_b, forwards_b) = results
    assert (forwards_a, forwards_b) == (2, 1)
    for name, tensor in weights_a.items():
        torch.testing.assert_close(weights_b[name], tensor, rtol=0, atol=1e-6)
    assert set(separate) == set(fused) and fused["routing_agreement"] == separate["routing_agreement"] > 0.5
    for key in ("loss", "clip_frac", "mismatch_kl_k3", "is_weight_mean", "entropy", "grad_norm"):
        assert fused[key] == pytest.approx(separate[key], rel=1e-5, abs=1e-7), key


def test_the_entropy_bonus_alone_raises_the_policys_entropy(tiny_model_dir):
    """Equal rewards: every advantage is 0, so the policy term has no gradient; with an entropy
    coefficient the step's one gradient is the bonus's, and π's entropy on the batch rises (without
    it nothing moves)."""
    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=3)
    for r in rollouts:
        r.reward = 1.0
    batch = collate(rollouts)
    mask = batch.loss_mask
    entropies = []
    for coef in (0.0, 0.5):
        torch.manual_seed(0)
        model = load_causal_lm(tiny_model_dir, "float32").train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        config = StepConfig(loss=LossConfig(entropy_coef=coef))
        with torch.no_grad():
            before = sequence_logprobs(model, batch).entropy_per_token[mask].mean().item()
        train_step(model, optimizer, RoutingController(model), batch, GROUP, config, version=0)
        with torch.no_grad():
            after = sequence_logprobs(model, batch).entropy_per_token[mask].mean().item()
        entropies.append((before, after))
    (plain_before, plain_after), (bonus_before, bonus_after) = entropies
    assert plain_after == pytest.approx(plain_before, abs=1e-6)
    assert bonus_after > bonus_before + 1e-3


def test_r3_without_traces_is_an_error(tiny_model_dir):
    rollouts = recorded_rollouts(tiny_model_dir, 1, seed=7)
    rollouts[0].routing_trace = None
    model = load_causal_lm(tiny_model_dir, "float32")
    with pytest.raises(ValueError, match="R3 needs a routing trace"):
        train_step(
            model,
            torch.optim.AdamW(model.parameters()),
            RoutingController(model),
            collate(rollouts),
            GROUP,
            StepConfig(replay="r3"),
            version=0,
        )


def test_stale_and_malformed_rollouts_never_train(tmp_path, tiny_model_dir, redis_server, run_id):
    fresh = recorded_rollouts(tiny_model_dir, 2, seed=11, version=0)
    future = recorded_rollouts(tiny_model_dir, 1, seed=12, version=9)  # from a version that does not exist
    template = recorded_rollouts(tiny_model_dir, 1, seed=13)[0]

    def broken(name, **changes):
        return dataclasses.replace(template, rollout_id=f"bad-{name}", group_id=f"bad-{name}", **changes)

    nan = template.inference_logprobs.copy()
    nan[1] = np.nan
    inf = template.inference_logprobs.copy()
    inf[0] = -np.inf
    out_of_range = template.routing_trace.copy()
    out_of_range[2, 1, 0] = 8  # the tiny model has experts 0..7
    malformed = [
        broken("nan", inference_logprobs=nan),
        broken("inf", inference_logprobs=inf),
        broken("expert", routing_trace=out_of_range),
        broken("trace", routing_trace=template.routing_trace[:-1]),  # one position short
        broken("lengths", inference_logprobs=template.inference_logprobs[:-1]),
        broken("oversize", prompt_token_ids=np.tile(template.prompt_token_ids, 2000)),  # > max_rollout_bytes
    ]
    before = {
        r: REGISTRY.get_sample_value("steadyrl_trainer_rollouts_dead_lettered_total", {"reason": r}) or 0
        for r in REASONS
    }

    async def main():
        redis = Redis.from_url(redis_server.url)
        stream = WorkQueue(redis, run_id).rollout_stream
        await redis.xadd(stream, {"r": b"\x00garbage"})
        await redis.xadd(stream, {"nothing": b"1"})
        await publish(redis, run_id, future + malformed + fresh)
        await serve_trainer(
            settings_for(
                tmp_path, tiny_model_dir, redis_server, run_id, max_steps=1, stream={"max_rollout_bytes": 4096}
            )
        )
        dead = await redis.xrange(stream + ":dead")
        pending = await redis.xpending(stream, "trainer")
        await redis.aclose()
        return dead, pending

    dead, pending = asyncio.run(asyncio.wait_for(main(), 120))
    reasons = sorted(fields[b"reason"].decode() for _, fields in dead)
    assert reasons == [
        "decode",
        "expert_range",
        "future_version",
        "future_version",
        "future_version",
        "future_version",
        "length",
        "missing_field",
        "nonfinite_logprobs",
        "nonfinite_logprobs",
        "oversize",
        "trace_shape",
    ]
    kept = {fields[b"reason"].decode(): fields[b"r"] for _, fields in dead}
    assert decode_rollout(kept["expert_range"]).rollout_id == "bad-expert"  # the payload is kept for inspection
    counted = {
        r: REGISTRY.get_sample_value("steadyrl_trainer_rollouts_dead_lettered_total", {"reason": r}) - before[r]
        for r in REASONS
    }
    assert counted == {r: reasons.count(r) for r in REASONS}
    assert pending["pending"] == 0
    line = json.loads((tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["step"] == 1 and line["tokens"] == sum(len(r.completion_token_ids) for r in fresh)


TRAINER_ENV = {
    "STEADYRL_TRAINER_PORT": "0",
    "STEADYRL_TRAINER_METRICS_PORT": "0",
    "STEADYRL_TRAINER_OPTIM__LR": "1e-3",
    "STEADYRL_TRAINER_BATCH_PROMPTS": "4",
    "STEADYRL_TRAINER_GROUP_SIZE": str(GROUP),
    "STEADYRL_TRAINER_MAX_STALENESS": "100",
    "STEADYRL_TRAINER_STREAM__READ_BLOCK_MS": "50",
    "STEADYRL_TRAINER_COMPUTE__TORCH_THREADS": "1",
}


def test_sigkilled_trainer_resumes_without_duplicate_or_gap(tmp_path, tiny_model_dir, redis_server, run_id):
    rollouts = recorded_rollouts(tiny_model_dir, 24, seed=21)  # 6 steps of 4 prompts
    env = {
        **os.environ,
        **TRAINER_ENV,
        "STEADYRL_TRAINER_MODEL_PATH": str(tiny_model_dir),
        "STEADYRL_TRAINER_OUT_DIR": str(tmp_path / "trainer"),
        "STEADYRL_TRAINER_REDIS_URL": redis_server.url,
        "STEADYRL_TRAINER_RUN_ID": run_id,
        "STEADYRL_TRAINER_MAX_STEPS": "6",
        "STEADYRL_LOG_LEVEL": "INFO",
        # a learning rate warmed up over 2 steps, then a cosine to a tenth: a function of the step alone
        "STEADYRL_TRAINER_OPTIM__SCHEDULE": "cosine",
        "STEADYRL_TRAINER_OPTIM__WARMUP_STEPS": "2",
        "STEADYRL_TRAINER_OPTIM__MIN_LR_RATIO": "0.1",
    }
    metrics = tmp_path / "trainer" / "metrics.jsonl"

    def steps_done() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    async def main():
        redis = Redis.from_url(redis_server.url)
        await publish(redis, run_id, rollouts)
        kills = []
        # between steps: right after step 1 is logged (checkpointed, acknowledged);
        # mid-step: as soon as step 3 has started (its forwards and optimizer steps are running)
        for marker in ("event=step step=1 ", "event=step_started step=3 "):
            trainer = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.trainer", env=env, stderr=subprocess.PIPE
            )
            while marker not in (line := (await trainer.stderr.readline()).decode()):
                assert line, "the trainer exited before the marker"
            os.kill(trainer.pid, signal.SIGKILL)
            await trainer.wait()
            kills.append((marker.strip(), steps_done()))
        final = subprocess.run([sys.executable, "-m", "services.trainer"], env=env, timeout=300)
        stream = WorkQueue(redis, run_id).rollout_stream
        ledger = [x.decode() for x in await redis.lrange(stream.rsplit(":", 1)[0] + ":trained", 0, -1)]
        pending = await redis.xpending(stream, "trainer")
        await redis.aclose()
        return kills, final.returncode, ledger, pending

    kills, code, ledger, pending = asyncio.run(asyncio.wait_for(main(), 600))
    assert code == 0 and pending["pending"] == 0
    assert len(ledger) == len(set(ledger)) == len(rollouts)  # no duplicate, no gap
    assert set(ledger) == {r.rollout_id for r in rollouts}
    state = json.loads((tmp_path / "trainer" / "checkpoints" / "step-00000006" / "state.json").read_text())
    assert state["version"] == 6 and len(state["consumed"]) == len(rollouts)
    print("trainer killed at", kills)
    assert kills[0][1] == 1 and kills[1][1] == 2  # the mid-step kill lost step 3 before its checkpoint
    # the restarted trainers continued the curve: 1e-3 × (0.5, 1, then cos from 1 to 0.1 over steps 3-6)
    lrs = {line["step"]: line["lr"] for line in map(json.loads, metrics.read_text().splitlines())}
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 3)) for k in range(4)]
    assert [lrs[step] for step in range(1, 7)] == pytest.approx([5e-4, 1e-3] + [1e-3 * c for c in cosine])
    assert lrs[6] == pytest.approx(1e-4)


def test_grpc_pause_resume_status_checkpoint(tmp_path, tiny_model_dir, redis_server, run_id):
    """A paused trainer holds a batch it could train: it stays at its step for three times what its
    step before took (so a slow machine cannot pass by being slow), Resume trains it, Status and
    Checkpoint say so."""
    import time

    import grpc

    from shared.rpc.steadyrl.v1 import trainer_pb2 as tpb
    from shared.rpc.steadyrl.v1 import trainer_pb2_grpc
    from shared.runstore.redis_server import free_port

    rollouts = recorded_rollouts(tiny_model_dir, 2, seed=51)
    held = recorded_rollouts(tiny_model_dir, 2, seed=52, version=1)  # on policy for step 2, as step 1's for 1
    port = free_port()

    async def at_step(stub, step: int):
        for _ in range(1200):
            status = await stub.Status(common_pb2.Empty())
            if status.step >= step:
                return status
            await asyncio.sleep(0.05)
        raise TimeoutError(f"the trainer never reached step {step}: {status}")

    async def main():
        redis = Redis.from_url(redis_server.url)
        stop = asyncio.Event()
        ready = asyncio.Event()
        server = asyncio.create_task(
            serve_trainer(
                settings_for(tmp_path, tiny_model_dir, redis_server, run_id, port=port), ready=ready, stop=stop
            )
        )
        await ready.wait()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            started = time.monotonic()
            await publish(redis, run_id, rollouts)
            first = await at_step(stub, 1)
            took = time.monotonic() - started  # from a batch on the stream to its step done
            paused = await stub.Pause(common_pb2.Empty())
            await publish(redis, run_id, held)
            idle = []
            until = time.monotonic() + 3 * took  # running, it would have trained by then
            while time.monotonic() < until:
                idle.append(await stub.Status(common_pb2.Empty()))
                await asyncio.sleep(0.05)
            resumed = await stub.Resume(common_pb2.Empty())
            status = await at_step(stub, 2)
            checkpoint = await stub.Checkpoint(tpb.CheckpointRequest(tag="manual"))
        stop.set()
        await server
        await redis.aclose()
        return first, paused, idle, resumed, status, checkpoint

    first, paused, idle, resumed, status, checkpoint = asyncio.run(asyncio.wait_for(main(), 180))
    assert first.step == 1 and first.rollouts_trained == 8 and not first.paused
    assert paused.paused and idle and all(s.paused and s.step == 1 and s.rollouts_trained == 8 for s in idle)
    assert not resumed.paused
    assert status.step == 2 and status.version.version == 2 and status.rollouts_trained == 16
    assert status.recipe == "minirl+tis+clip" and "reward_mean" in status.last_metrics
    assert checkpoint.step == 2 and checkpoint.version == 2
    assert (tmp_path / "trainer" / "checkpoints" / "step-00000002" / "shards").is_dir()


async def trainer_holding(tmp_path, model_dir, redis_server, run_id, rollouts, **overrides):
    """A Trainer in this event loop that has read `rollouts` from the stream into its groups."""
    from services.trainer.loop import Trainer

    redis = Redis.from_url(redis_server.url)
    await publish(redis, run_id, rollouts)
    trainer = Trainer(settings_for(tmp_path, model_dir, redis_server, run_id, **overrides), redis)
    await trainer.source.open()
    while trainer.buffer.held < len(rollouts):
        await trainer.intake.take(await trainer.source.read(50))
    return redis, trainer


def test_settling_again_after_a_lost_reply_changes_nothing(tmp_path, tiny_model_dir, redis_server, run_id):
    """Redis can apply a settlement and go down before its reply arrives; the trainer then settles
    the same entries again. Trained, dropped and dead-lettered entries are each recorded once, and a
    ledger Redis lost is written back once."""
    rollouts = recorded_rollouts(tiny_model_dir, 3, seed=61)

    async def main():
        redis, trainer = await trainer_holding(tmp_path, tiny_model_dir, redis_server, run_id, rollouts)
        keys = trainer.source.keys
        (trained_gid, trained), (stale_gid, stale), (dead_gid, dead) = list(trainer.buffer.groups.items())
        items = [(held.entry, held.rollout.rollout_id) for held in trained.values()]
        trainer.state.consumed.update(rid for _, rid in items)
        appended = [await trainer.source.trained(items) for _ in range(2)]
        del trainer.buffer.groups[trained_gid], trainer.buffer.groups[dead_gid]
        trainer.state.version = 10  # the stale group is now beyond max_staleness
        await trainer.intake.drop_stale(trainer.settings.max_staleness)
        trainer.buffer.groups[stale_gid] = stale  # its settlement "failed": still held, dropped again
        await trainer.intake.drop_stale(trainer.settings.max_staleness)
        entry = next(iter(dead.values())).entry
        for _ in range(2):
            await trainer.source.dead_letter(entry, "decode", "test", b"x")
        ledger = [x.decode() for x in await redis.lrange(keys.trained, 0, -1)]
        dropped = [x.decode() for x in await redis.lrange(keys.dropped, 0, -1)]
        dead_letters = await redis.xlen(keys.rollouts_dead)
        await redis.delete(keys.trained, keys.trained_ids, keys.dropped)  # Redis came back without them
        await trainer.intake.reconcile(set())
        await trainer.intake.reconcile(set())
        restored = [x.decode() for x in await redis.lrange(keys.trained, 0, -1)]
        restored_dropped = [x.decode() for x in await redis.lrange(keys.dropped, 0, -1)]
        left = await redis.xlen(keys.rollouts)
        await redis.aclose()
        return (
            items,
            appended,
            ledger,
            dropped,
            sorted(h.rollout.rollout_id for h in stale.values()),
            dead_letters,
            restored,
            restored_dropped,
            left,
        )

    items, appended, ledger, dropped, stale, dead_letters, restored, restored_dropped, left = asyncio.run(
        asyncio.wait_for(main(), 120)
    )
    assert appended == [GROUP, 0]
    assert ledger == [rid for _, rid in items]
    assert sorted(dropped) == stale and len(stale) == GROUP
    assert dead_letters == 1
    assert sorted(restored) == sorted(ledger)
    # a stale drop Redis lost is written back once too: else its task stays outstanding for the
    # orchestrator's admission forever (a whole run stalled so after an emulated host crash)
    assert sorted(restored_dropped) == stale
    assert left == GROUP - 1  # only the dead group's other members remain, unsettled


def test_a_checkpoint_request_or_a_stop_during_a_step_waits_for_the_step(
    tmp_path, tiny_model_dir, redis_server, run_id
):
    """The training thread cannot be interrupted: a Checkpoint request during a step saves the
    step whole once it ends (never a half-updated model), and a stop (cancel) lets the step finish
    its bookkeeping, so the rollouts it trained are never trained again after a restart."""
    import threading

    rollouts = recorded_rollouts(tiny_model_dir, 4, seed=71)

    async def main():
        redis, trainer = await trainer_holding(tmp_path, tiny_model_dir, redis_server, run_id, rollouts)
        gate = threading.Event()
        train = trainer.runner.step
        trainer.runner.step = lambda batch, version: (gate.wait(30), train(batch, version))[1]  # hold it mid-step
        stepping = asyncio.create_task(trainer.step(trainer.buffer.complete()[:2]))
        await asyncio.sleep(0.2)
        saving = asyncio.create_task(trainer.checkpoint_now())
        await asyncio.sleep(0.5)
        waited = not saving.done() and trainer.reported == (0, 0, 0)
        gate.set()
        await stepping
        saved = await saving
        gate.clear()
        stopped = asyncio.create_task(trainer.step(trainer.buffer.complete()[:2]))
        await asyncio.sleep(0.2)
        stopped.cancel()  # a clean stop arrives mid-step
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await stopped
        ledger = await redis.lrange(trainer.source.keys.trained, 0, -1)
        await redis.aclose()
        return waited, saved, trainer, ledger

    waited, saved, trainer, ledger = asyncio.run(asyncio.wait_for(main(), 120))
    assert waited  # the Checkpoint request waited for the step; Status still reported step 0
    assert saved.name == "step-00000001" and json.loads((saved / "state.json").read_text())["step"] == 1
    assert trainer.reported == (2, 2, 4 * GROUP) and trainer.state.step == 2  # the cancelled step finished
    assert len(ledger) == 4 * GROUP  # and was checkpointed and acknowledged (checkpoint_every=1)
    latest = json.loads((tmp_path / "trainer" / "checkpoints" / "step-00000002" / "state.json").read_text())
    assert len(latest["consumed"]) == 4 * GROUP


def test_a_written_checkpoint_lands_and_acknowledges_beside_the_next_step(
    tmp_path, tiny_model_dir, redis_server, run_id
):
    """An async checkpoint needs no model once its shards are written: it is put in place and its
    rollouts acknowledged while the next step trains (it used to hold that step back)."""
    import concurrent.futures
    import threading

    rollouts = recorded_rollouts(tiny_model_dir, 4, seed=83)

    async def main():
        redis, trainer = await trainer_holding(tmp_path, tiny_model_dir, redis_server, run_id, rollouts)
        written, gate = threading.Event(), threading.Event()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        save, train = trainer.runner.save, trainer.runner.step

        def held_save(state):  # the shards count as written once `written` is set
            pending = save(state)
            inner = pending.future
            pending.future = pool.submit(lambda: (written.wait(30), inner and inner.result()))
            return pending

        trainer.runner.save = held_save
        trainer.runner.step = lambda batch, version: (gate.wait(30), train(batch, version))[1]
        gate.set()
        await trainer.step(trainer.buffer.complete()[:2])  # step 1: its checkpoint still being written
        gate.clear()
        unsettled = trainer.acks.saving is not None
        trainer.stepping.begin(trainer.buffer.complete()[:2])  # step 2, held mid-step
        written.set()
        while not trainer.acks.save_done():
            await asyncio.sleep(0.01)
        await trainer.tend()
        await asyncio.wait_for(asyncio.shield(trainer.settling.task), 30)
        beside = not trainer.stepping.task.done()
        acknowledged = len(await redis.lrange(trainer.source.keys.trained, 0, -1))
        latest = (tmp_path / "trainer" / "checkpoints" / "LATEST").read_text().strip()
        gate.set()
        await trainer.stepping.carry()
        await trainer.publishing.announced()
        pool.shutdown()
        await redis.aclose()
        return unsettled, beside, acknowledged, latest, trainer.state.step

    unsettled, beside, acknowledged, latest, step = asyncio.run(asyncio.wait_for(main(), 120))
    assert unsettled  # step 1 ended before its checkpoint was in place
    assert beside  # ...which landed while step 2 was still training
    assert acknowledged == 2 * GROUP and latest == "step-00000001"
    assert step == 2


def test_no_held_check_while_a_version_is_on_its_way_out(tmp_path, tiny_model_dir, redis_server, run_id):
    """Weight-sync's latest, asked while the trainer's last version is being announced, may be the
    one before: lowering `published` to it would publish that version again, refused as not newer."""
    from services.trainer.loop import Trainer

    async def main():
        redis = Redis.from_url(redis_server.url)
        settings = settings_for(
            tmp_path, tiny_model_dir, redis_server, run_id, weightsync_address="127.0.0.1:9", unsigned_weights=True
        )
        trainer = Trainer(settings, redis)
        await trainer.source.open()
        trainer.reading.redis_id = await trainer.source.identity()
        announcing = asyncio.get_running_loop().create_future()
        publishing = trainer.publishing
        publishing.announcing, publishing.next_held_check = announcing, 0.0
        await trainer.tend()
        during = publishing.next_held_check
        announcing.set_result(None)
        await trainer.tend()  # out: the check runs (weight-sync unreachable: assumed held)
        after = publishing.next_held_check
        await redis.aclose()
        return during, after, publishing.announcing

    during, after, announcing = asyncio.run(asyncio.wait_for(main(), 60))
    assert during == 0.0 and after > 0.0 and announcing is None


def test_a_version_lost_by_a_restarted_weightsync_is_published_again(tmp_path, tiny_model_dir, redis_server, run_id):
    """Weight-sync restarted right after the trainer's last push (its memory, and that version,
    gone): replicas would wait for a version nobody pushes again. The trainer notices that
    weight-sync no longer holds it and pushes its current weights again."""
    from services.trainer.version_publisher import VersionPublisher
    from services.weightsync.config import WeightSyncSettings
    from services.weightsync.server import serve as serve_weightsync
    from shared.runstore.redis_server import free_port
    from shared.weightsync.grpc import latest_version
    from shared.weightsync.signing import write_key_pair

    port = free_port()
    address = f"127.0.0.1:{port}"
    weights = {k: v.clone() for k, v in load_causal_lm(tiny_model_dir, "float32").state_dict().items()}
    private, public = write_key_pair(tmp_path / "keys")

    async def weightsync(name: str):
        stop = asyncio.Event()
        ready = asyncio.Event()
        task = asyncio.create_task(
            serve_weightsync(
                WeightSyncSettings(
                    port=port, metrics_port=0, run_id=run_id, spill_dir=tmp_path / name, verify_key_file=public
                ),
                ready,
                stop,
            )
        )
        await asyncio.wait_for(ready.wait(), 30)
        return stop, task

    async def main():
        redis = Redis.from_url(redis_server.url)
        publisher = VersionPublisher(
            settings_for(
                tmp_path,
                tiny_model_dir,
                redis_server,
                run_id,
                weightsync_address=address,
                publish={"signing_key_file": private},
            ),
            redis,
        )
        stop, task = await weightsync("first")
        assert await publisher.publish(weights, 1) and await publisher.publish(weights, 2)
        held_before = await publisher.held_by_weightsync()
        stop.set()
        await task
        stop, task = await weightsync("second")  # the same address, nothing held
        held_after = await publisher.held_by_weightsync()
        fallback = publisher.published
        republished = await publisher.publish(weights, 2)
        latest = await latest_version(address)
        await publisher.close()
        stop.set()
        await task
        await redis.aclose()
        return held_before, held_after, fallback, republished, latest

    held_before, held_after, fallback, republished, latest = asyncio.run(asyncio.wait_for(main(), 120))
    assert held_before is True and held_after is False and fallback == 0
    assert republished and latest == 2


def test_a_refused_push_is_reported_and_never_counted_as_published(tmp_path, tiny_model_dir, redis_server, run_id):
    """Weight-sync holding other weights under a number is a refusal the trainer
    reports (counted, logged) and does not take for published; a push repeated after a lost reply
    is a success."""
    from services.trainer.version_publisher import PUBLISH_FAILURES, VersionPublisher
    from services.weightsync.config import WeightSyncSettings
    from services.weightsync.server import serve as serve_weightsync
    from shared.runstore.redis_server import free_port
    from shared.weightsync.grpc import GrpcWeightPublisher
    from shared.weightsync.signing import Signer, write_key_pair

    port = free_port()
    address = f"127.0.0.1:{port}"
    weights = {k: v.clone() for k, v in load_causal_lm(tiny_model_dir, "float32").state_dict().items()}
    other = {k: v + 1 if v.is_floating_point() else v for k, v in weights.items()}
    private, public = write_key_pair(tmp_path / "keys")

    async def main():
        redis = Redis.from_url(redis_server.url)
        stop = asyncio.Event()
        ready = asyncio.Event()
        task = asyncio.create_task(
            serve_weightsync(
                WeightSyncSettings(
                    port=port, metrics_port=0, run_id=run_id, spill_dir=tmp_path / "spill", verify_key_file=public
                ),
                ready,
                stop,
            )
        )
        await asyncio.wait_for(ready.wait(), 30)
        publisher = VersionPublisher(
            settings_for(
                tmp_path,
                tiny_model_dir,
                redis_server,
                run_id,
                weightsync_address=address,
                publish={"signing_key_file": private},
            ),
            redis,
        )
        first = await publisher.publish(weights, 1)
        repeated = await publisher.publish(weights, 1)  # as after a reply lost on the way back
        elsewhere = GrpcWeightPublisher(address, Signer.from_file(private, run_id))  # another process, same key
        await elsewhere.push(other, 2, 1)
        await elsewhere.close()
        refusals = PUBLISH_FAILURES.labels("FAILED_PRECONDITION")._value.get()
        refused = await publisher.publish(weights, 2)
        counted = PUBLISH_FAILURES.labels("FAILED_PRECONDITION")._value.get() - refusals
        after_refusal = publisher.published
        later = await publisher.publish(weights, 3)
        await publisher.close()
        stop.set()
        await task
        await redis.aclose()
        return first, repeated, refused, counted, after_refusal, later, publisher.published

    first, repeated, refused, counted, after_refusal, later, published = asyncio.run(asyncio.wait_for(main(), 120))
    assert (first, repeated, refused, counted, after_refusal) == (True, True, False, 1, 1)
    assert later and published == 3
