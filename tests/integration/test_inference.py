"""Inference on the tiny MoE: the torch engine against fresh forwards, and a whole replica (real
redis-server, real weight-sync, real gRPC) publishing rollouts, switching weights, surviving a
SIGKILL."""

import asyncio
import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch
from redis.asyncio import Redis

from services.inference.config import InferenceSettings
from services.inference.server import ReplicaParts
from services.inference.server import serve as serve_inference
from services.weightsync.config import WeightSyncSettings
from services.weightsync.server import serve as serve_weightsync
from shared.engines import Sampling, make_engine
from shared.kit.tiny import TinySpec, char_tokenizer, encode_prompts
from shared.models import load_causal_lm
from shared.models.routing import RoutingController
from shared.rollouts.record import decode_rollout, decode_trace
from shared.rpc.steadyrl.v1 import common_pb2, inference_pb2_grpc, rollout_pb2
from shared.rpc.steadyrl.v1 import inference_pb2 as pb
from shared.runstore.queues import WorkQueue
from shared.runstore.redis_server import free_port
from shared.weightsync.grpc import GrpcWeightPublisher
from shared.weightsync.signing import Signer, write_key_pair
from steadyrl.recipe import merge_tables
from tests.helpers import submit


def prompts_of(count: int, seed: int = 0) -> list[list[int]]:
    examples = TinySpec().task(seed).split("train", count)
    return encode_prompts(char_tokenizer(), [e.prompt for e in examples])


def fresh_forward(model, prompt: list[int], completion: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Logprobs of `completion` and the routing trace from one full forward, no cache, no padding."""
    ids = torch.tensor([prompt + completion])
    routing = RoutingController(model)
    try:
        with torch.no_grad(), routing.capture() as recording:
            logits = model(ids).logits[0].float()
        trace = recording.trace(ids.shape)[0, :-1].numpy()
    finally:
        routing.close()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1), trace


def test_torch_engine_logprobs_and_traces_equal_a_fresh_forward(tiny_model_dir):
    engine = make_engine("torch", str(tiny_model_dir), "float32")
    reference = load_causal_lm(tiny_model_dir, "float32")
    prompts = prompts_of(6)
    prompts[1] = prompts[1][3:]
    prompts[4] = prompts[4][:2]  # ragged lengths: left padding at work
    samples = engine.generate(prompts, Sampling(temperature=1.0, max_new_tokens=12, seed=7), return_trace=True)
    worst = 0.0
    for prompt, sample in zip(prompts, samples, strict=True):
        logp, trace = fresh_forward(reference, prompt, sample.token_ids)
        worst = max(worst, float((logp - torch.tensor(sample.logprobs)).abs().max()))
        assert sample.routing_trace.shape == (len(prompt) + len(sample.token_ids) - 1, 2, 2)
        np.testing.assert_array_equal(sample.routing_trace, trace)
        assert sample.versions == [0] * len(sample.token_ids)
        assert sample.finish_reason == ("stop" if sample.token_ids[-1] == 2 else "length")
    assert worst <= 1e-5
    # temperature and top-p: the logprob is under the truncated, renormalised distribution
    [hot] = engine.generate(prompts[:1], Sampling(temperature=0.7, top_p=0.9, max_new_tokens=6, seed=1))
    assert all(lp <= 0 for lp in hot.logprobs)
    [again] = engine.generate(prompts[:1], Sampling(temperature=0.7, top_p=0.9, max_new_tokens=6, seed=1))
    assert again.token_ids == hot.token_ids  # seeded sampling is reproducible


def test_continuous_batching_admits_and_retires_rows_and_stays_exact(tiny_model_dir):
    """Sequences submitted while others run, of ragged lengths, some stopping early: each one's
    logprobs and routing trace equal a fresh full forward of it alone."""
    import threading

    engine = make_engine("torch", str(tiny_model_dir), "float32", max_num_seqs=5)
    reference = load_causal_lm(tiny_model_dir, "float32")
    prompts = prompts_of(12, seed=3)
    prompts[2] = prompts[2][2:]
    prompts[7] = prompts[7][:3]
    futures = []
    rows = []

    def watch(token, logprob, version):
        rows.append(engine.running)

    for i, prompt in enumerate(prompts):  # staggered: newcomers join a batch that is mid-generation
        sampling = Sampling(temperature=1.0, max_new_tokens=4 + 3 * (i % 4), seed=11, ignore_eos=i % 3 == 0)
        futures.append(engine.start(prompt, sampling, return_trace=True, on_token=watch if i == 0 else None, index=i))
        threading.Event().wait(0.003 * (i % 3))
    samples = [f.result(60) for f in futures]
    worst = 0.0
    for i, (prompt, sample) in enumerate(zip(prompts, samples, strict=True)):
        logp, trace = fresh_forward(reference, prompt, sample.token_ids)
        worst = max(worst, float((logp - torch.tensor(sample.logprobs)).abs().max()))
        np.testing.assert_array_equal(sample.routing_trace, trace)
        if i % 3 == 0:  # ignore_eos: always the full length
            assert len(sample.token_ids) == 4 + 3 * (i % 4) and sample.finish_reason == "length"
    print(f"continuous batching vs fresh forwards: |dlogprob| max {worst:.2e}")
    assert worst <= 1e-4  # fp32 noise of other batch shapes (1.1e-5 to 2.8e-5 seen); traces are exact
    assert max(rows) <= 5 and engine.running == 0  # never more than max_num_seqs; every row retired
    assert engine.steps < sum(len(s.token_ids) for s in samples)  # rows shared steps
    engine.close()


def test_a_groups_copies_of_one_prompt_are_prefilled_once_and_stay_exact(tiny_model_dir):
    """G samples of one prompt (and another prompt's G) enter together: the prefill forward runs on
    the 2 distinct prompts, not 2·G rows; every sample's logprobs and routing trace (one copy asked
    for it, the prompt's computed row did not) still equal a fresh forward of it alone."""
    from shared.engines import sequences

    engine = make_engine("torch", str(tiny_model_dir), "float32")
    reference = load_causal_lm(tiny_model_dir, "float32")
    widths = []
    forward = sequences.forward
    sequences.forward = lambda model, routing, act, ids, *rest: (
        widths.append(ids.shape),
        forward(model, routing, act, ids, *rest),
    )[1]
    try:
        first, second = prompts_of(2, seed=5)
        group = [first] * 6 + [second[2:]] * 4
        with engine._wake:  # every request queued before the engine admits any: one step, one prefill
            futures = engine.start_many(group[:3], Sampling(temperature=1.0, max_new_tokens=5, seed=3))
            futures += [engine.start(first, Sampling(temperature=1.0, max_new_tokens=5), True, index=i) for i in (3, 4)]
            futures += engine.start_many(group[5:6], Sampling(temperature=1.0, max_new_tokens=5, seed=3))
            futures += engine.start_many(group[6:], Sampling(temperature=1.0, max_new_tokens=5, seed=4), True)
        samples = [f.result(60) for f in futures]
    finally:
        sequences.forward = forward
    worst = 0.0
    for i, (prompt, sample) in enumerate(zip(group, samples, strict=True)):
        logp, trace = fresh_forward(reference, prompt, sample.token_ids)
        worst = max(worst, float((logp - torch.tensor(sample.logprobs)).abs().max()))
        if i in (3, 4) or i >= 6:
            np.testing.assert_array_equal(sample.routing_trace, trace)
        else:
            assert sample.routing_trace is None
    assert worst <= 1e-4
    assert len({tuple(s.token_ids) for s in samples[:6]}) > 1  # the copies sampled on their own
    prefills = [shape for shape in widths if shape[1] > 1]
    assert prefills and all(rows <= 2 for rows, _ in prefills)  # one row per distinct prompt
    engine.close()


def _v1(engine):
    return {
        k: v * 1.5 if k == "lm_head.weight" else (-v if k.endswith("mlp.gate.weight") else v)
        for k, v in engine.model.state_dict().items()
    }


def test_an_update_lands_in_flight_and_every_token_is_its_version(tiny_model_dir):
    """A weight update during a long generation: tokens before it carry v0, after it v1, and each
    token's logprob is the recompute, over the whole prefix, of the weights that sampled it."""
    import threading

    engine = make_engine("torch", str(tiny_model_dir), "float32")
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items()}
    v1 = _v1(engine)
    applied = threading.Event()

    def switch(token, logprob, version):
        if not applied.is_set():
            applied.set()
            threading.Thread(target=engine.update_weights, args=(1, v1)).start()  # from weight-sync's thread

    sampling = Sampling(temperature=1.0, max_new_tokens=20, seed=5, ignore_eos=True)
    [long, short] = [
        engine.start(p, sampling, True, switch if i == 0 else None, i) for i, p in enumerate(prompts_of(2))
    ]
    samples = [long.result(60), short.result(60)]
    models = {}
    for version, weights in ((0, v0), (1, v1)):
        models[version] = load_causal_lm(tiny_model_dir, "float32")
        models[version].load_state_dict(weights)
    for prompt, sample in zip(prompts_of(2), samples, strict=True):
        switch_at = sample.versions.index(1)
        assert 1 <= switch_at < len(sample.versions) - 1, sample.versions
        assert sample.versions == [0] * switch_at + [1] * (len(sample.versions) - switch_at)
        for version, model in models.items():
            logp, _ = fresh_forward(model, prompt, sample.token_ids)
            mine = [i for i, v in enumerate(sample.versions) if v == version]
            assert float((logp[mine] - torch.tensor(sample.logprobs)[mine]).abs().max()) <= 1e-4
        assert sample.routing_trace.shape[0] == len(prompt) + len(sample.token_ids) - 1
    assert engine.version == 1 and 1 in engine.first_token_at
    engine.close()


def test_between_requests_drains_the_running_sequences_first(tiny_model_dir):
    import threading

    engine = make_engine("torch", str(tiny_model_dir), "float32", update_mode="between_requests")
    v1 = _v1(engine)
    sampling = Sampling(temperature=1.0, max_new_tokens=16, seed=5, ignore_eos=True)
    staged = []

    def stage(token, logprob, version):  # weight-sync hands the version over from its own thread
        if not staged:
            staged.append(threading.Thread(target=engine.update_weights, args=(1, v1)))
            staged[0].start()

    first = engine.start(prompts_of(1)[0], sampling, on_token=stage)
    sample = first.result(60)
    later = engine.generate(prompts_of(2), sampling)  # queued while the version waits: they start on it
    staged[0].join(60)
    assert sample.versions == [0] * 16  # the running sequence finished on v0
    assert all(s.versions == [1] * 16 for s in later) and engine.version == 1
    engine.close()


def test_an_update_waits_for_the_running_step_and_lands_between_two(tiny_model_dir):
    """Weight-sync hands a version over while a step runs: it waits for that step (generation is
    never fed half-copied weights), lands before the next, in place, and is refused from the
    engine's own thread (which would wait on itself)."""
    import threading

    engine = make_engine("torch", str(tiny_model_dir), "float32")
    new_weights = {k: v * 1.5 if k == "lm_head.weight" else v for k, v in engine.model.state_dict().items()}
    storage = engine.model.lm_head.weight.data_ptr()
    with engine._lock:  # a step runs; weight-sync delivers version 1 from its own thread
        stager = threading.Thread(target=engine.update_weights, args=(1, new_weights))
        stager.start()
        stager.join(0.5)
        assert stager.is_alive() and engine.version == 0  # it waits for the step
    stager.join(30)
    assert engine.version == 1 and torch.equal(engine.model.lm_head.weight, new_weights["lm_head.weight"])
    assert engine.model.lm_head.weight.data_ptr() == storage  # copied into the model's own tensor
    errors = []

    def from_the_engine(token, logprob, version):
        if not errors:
            try:
                engine.update_weights(2, new_weights)
            except RuntimeError as exc:
                errors.append(str(exc))

    engine.start(prompts_of(1)[0], Sampling(max_new_tokens=2), on_token=from_the_engine).result(60)
    assert errors and "own thread" in errors[0] and engine.version == 1
    engine.close()


def test_a_cancelled_sequence_leaves_the_batch(tiny_model_dir):
    engine = make_engine("torch", str(tiny_model_dir), "float32")
    sampling = Sampling(temperature=1.0, max_new_tokens=40, seed=1, ignore_eos=True)
    doomed = engine.start(prompts_of(1)[0], sampling)
    other = engine.start(prompts_of(2)[1], sampling, index=1)
    while engine.running < 2:
        threading_wait = __import__("threading").Event().wait
        threading_wait(0.001)
    doomed.cancel()
    assert len(other.result(60).token_ids) == 40 and len(doomed.result(60).token_ids) < 40
    assert engine.running == 0
    engine.close()


class Replica:
    """Weight-sync and one inference replica served in this process, on loopback."""

    def __init__(self, tmp_path, model_dir, redis_url, run_id, ws_overrides=None, engine=None, **overrides):
        self.ws_port = free_port()
        self.port = free_port()
        private, public = write_key_pair(tmp_path / "keys")
        self.signer = Signer.from_file(private, run_id)  # the trainer's key: versions the replica takes
        self.ws_settings = WeightSyncSettings(
            port=self.ws_port,
            metrics_port=0,
            spill_dir=tmp_path / "spill",
            run_id=run_id,
            **{"verify_key_file": public, **(ws_overrides or {})},
        )
        self.engine = engine or make_engine("torch", str(model_dir), "float32")
        self.settings = InferenceSettings(
            port=self.port,
            metrics_port=0,
            model_path=str(model_dir),
            dtype="float32",
            redis_url=redis_url,
            run_id=run_id,
            replica_id="replica-a",
            weightsync_address=f"127.0.0.1:{self.ws_port}",
            **merge_tables({"verify_key_file": public, "tasks": {"lease_seconds": 5}}, overrides),
        )
        self.stop = asyncio.Event()
        self.parts = ReplicaParts()  # the agent endpoint, once ready

    async def __aenter__(self):
        from shared.runstore.run_instance import run_instance

        redis = Redis.from_url(self.settings.redis_url.get_secret_value())
        self.signer.instance = await run_instance(redis, self.settings.run_id)  # this run's, as the trainer signs
        await redis.aclose()
        ws_ready = asyncio.Event()
        ready = asyncio.Event()
        self.tasks = [asyncio.create_task(serve_weightsync(self.ws_settings, ws_ready, self.stop))]
        await ws_ready.wait()
        self.tasks.append(
            asyncio.create_task(
                serve_inference(self.settings, self.engine, ready=ready, stop=self.stop, parts=self.parts)
            )
        )
        await asyncio.wait_for(ready.wait(), 60)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        self.stop.set()
        await asyncio.gather(*self.tasks)


def arith_task(task_id: str, prompt: list[int], answer: str, group_size: int, **fields) -> common_pb2.PromptTask:
    return common_pb2.PromptTask(
        task_id=task_id,
        task_name="exact_match",
        prompt_token_ids=prompt,
        answer=answer,
        group_size=group_size,
        sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=8, seed=5),
        **fields,
    )


async def wait_for(predicate, timeout: float = 60.0):
    for _ in range(int(timeout / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("condition not reached")


def test_replica_publishes_scored_rollouts_with_the_pulled_version(tmp_path, tiny_model_dir, redis_server, run_id):
    examples = TinySpec().task().split("train", 3)
    prompts = encode_prompts(char_tokenizer(), [e.prompt for e in examples])
    v1 = load_causal_lm(tiny_model_dir, "float32")
    with torch.no_grad():
        v1.model.layers[1].mlp.gate.weight.mul_(-1.0)  # a different router: different routing and answers

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        async with Replica(tmp_path, tiny_model_dir, redis_server.url, run_id) as replica:
            publisher = GrpcWeightPublisher(f"127.0.0.1:{replica.ws_port}", replica.signer)
            await publisher.push(v1.state_dict(), 1)
            await wait_for(lambda: _version_is(replica.stub, 1))
            for i, (prompt, example) in enumerate(zip(prompts, examples, strict=True)):
                await submit(queue, arith_task(f"task{i}", prompt, example.answer, 4, min_policy_version=1))
            await wait_for(lambda: _completed(queue, 3))
            status = await replica.stub.Status(common_pb2.Empty())
            entries = await redis.xrange(queue.rollout_stream)
            await publisher.close()
        await redis.aclose()
        return status, entries

    status, entries = asyncio.run(asyncio.wait_for(main(), 120))
    assert (status.replica_id, status.engine, status.version.version) == ("replica-a", "torch", 1)
    assert status.capabilities.routing_trace and status.rollouts_published == 12 and status.queue_lag == 0
    rollouts = [decode_rollout(fields[b"r"]) for _, fields in entries]
    assert sorted(r.rollout_id for r in rollouts) == sorted(f"task{t}:{s}" for t in range(3) for s in range(4))
    worst = 0.0
    for r in rollouts:
        assert r.group_size == 4 and r.replica_id == "replica-a" and r.engine == "torch"
        assert set(r.policy_versions.tolist()) == {1}
        example = examples[int(r.task_id[-1])]
        text = char_tokenizer().decode(r.completion_token_ids.tolist(), skip_special_tokens=True)
        assert r.reward == (1.0 if text.strip() == example.answer else 0.0)
        logp, trace = fresh_forward(v1, r.prompt_token_ids.tolist(), r.completion_token_ids.tolist())
        worst = max(worst, float((logp - torch.from_numpy(r.inference_logprobs)).abs().max()))
        np.testing.assert_array_equal(r.routing_trace, trace)
    assert worst <= 1e-5


async def _version_is(stub, version: int) -> bool:
    return (await stub.Status(common_pb2.Empty())).version.version == version


async def _completed(queue: WorkQueue, count: int) -> bool:
    return (await queue.depths()).completed >= count


async def _dead(queue: WorkQueue, count: int) -> bool:
    return (await queue.depths()).dead >= count


def test_generate_streams_tokens_and_refuses_bad_requests(tmp_path, tiny_model_dir, redis_server, run_id):
    prompt = prompts_of(1)[0]

    async def main():
        async with Replica(tmp_path, tiny_model_dir, redis_server.url, run_id) as replica:
            request = pb.GenerateRequest(
                prompt_token_ids=prompt,
                return_routing_trace=True,
                sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=6),
            )
            events = [e async for e in replica.stub.Generate(request)]
            by_text = [
                e
                async for e in replica.stub.Generate(
                    pb.GenerateRequest(prompt_text="<s>12+34=", sampling=common_pb2.SamplingParams(max_new_tokens=3))
                )
            ]
            codes = {}
            for name, bad in {
                "empty": pb.GenerateRequest(),
                "vocab": pb.GenerateRequest(prompt_token_ids=[1, 999]),
                "top_p": pb.GenerateRequest(prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(top_p=1.5)),
                "long": pb.GenerateRequest(
                    prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=10_000)
                ),
                "megabytes": pb.GenerateRequest(prompt_text="1+2=" * 1_500_000),  # 6 MB: refused untokenized
                "both": pb.GenerateRequest(prompt_token_ids=prompt, prompt_text="1+2="),
            }.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [e async for e in replica.stub.Generate(bad)]
                codes[name] = (err.value.code(), err.value.details())
            status = await replica.stub.Status(common_pb2.Empty())
        return events, by_text, codes, status

    events, by_text, codes, status = asyncio.run(asyncio.wait_for(main(), 120))
    *tokens, final = events
    assert final.done and final.token_id == -1 and final.finish_reason in ("stop", "length")
    assert 1 <= len(tokens) <= 6 and all(not e.done and e.inference_logprob <= 0 for e in tokens)
    trace = rollout_pb2.RoutingTrace.FromString(final.routing_trace)
    assert (trace.num_positions, trace.num_layers, trace.top_k) == (len(prompt) + len(tokens) - 1, 2, 2)
    ids, experts = decode_trace(trace)
    assert ids.shape == (trace.num_positions, 2, 2) and ids.dtype == np.uint8 and int(ids.max()) < experts
    # greedy: the streamed tokens are the engine's argmax continuation of the same prompt
    engine = make_engine("torch", str(tiny_model_dir), "float32")
    [greedy] = engine.generate([prompt], Sampling(temperature=0, max_new_tokens=6))
    assert [e.token_id for e in tokens] == greedy.token_ids
    assert by_text[-1].done and len(by_text) >= 2
    assert codes["empty"][0] == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in codes["empty"][1]
    assert codes["vocab"][0] == grpc.StatusCode.INVALID_ARGUMENT and "999" in codes["vocab"][1]
    assert codes["top_p"][0] == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in codes["top_p"][1]
    assert codes["long"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert codes["both"] == (grpc.StatusCode.INVALID_ARGUMENT, "give prompt_token_ids or prompt_text, not both")
    assert codes["megabytes"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "6000000 characters" in codes["megabytes"][1]
    assert status.capabilities.dtype == "float32" and status.model == str(tiny_model_dir)


def replica_env(model_dir, redis_url: str, run_id: str, replica: str, lease_seconds: float) -> dict[str, str]:
    """The environment of a replica process (`python -m services.inference`) on the tiny model."""
    return {
        **os.environ,
        "STEADYRL_INFERENCE_MODEL_PATH": str(model_dir),
        "STEADYRL_INFERENCE_DTYPE": "float32",
        "STEADYRL_INFERENCE_REDIS_URL": redis_url,
        "STEADYRL_INFERENCE_RUN_ID": run_id,
        "STEADYRL_INFERENCE_PORT": "0",
        "STEADYRL_INFERENCE_METRICS_PORT": "0",
        "STEADYRL_INFERENCE_TASKS__LEASE_SECONDS": str(lease_seconds),
        "STEADYRL_INFERENCE_REPLICA_ID": replica,
        "STEADYRL_INFERENCE_TORCH_THREADS": "1",
    }


def test_a_replica_sigkilled_mid_task_loses_nothing(tmp_path, tiny_model_dir, redis_server, run_id):
    group = 512
    prompt = prompts_of(1)[0]
    env = replica_env(tiny_model_dir, redis_server.url, run_id, "doomed", 1.5)

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        task = arith_task("slow", prompt, "0", group)
        task.sampling.max_new_tokens = 48
        task.sampling.temperature = 5.0  # near-uniform sampling: long sequences, a long generation
        await submit(queue, task)
        replica = subprocess.Popen([sys.executable, "-m", "services.inference"], env=env)
        try:
            await wait_for(lambda: _owned_by(redis, queue, "slow", b"doomed"), 90)
            os.kill(replica.pid, signal.SIGKILL)  # mid-generation: leased, nothing published yet
            assert replica.wait(10) == -signal.SIGKILL
        finally:
            if replica.poll() is None:
                replica.kill()
        assert (await queue.depths()).rollouts == 0
        await asyncio.sleep(1.6)
        assert await queue.requeue_expired(max_attempts=3) == (1, 0)
        settings = InferenceSettings(
            port=free_port(),
            metrics_port=0,
            model_path=str(tiny_model_dir),
            dtype="float32",
            redis_url=redis_server.url,
            run_id=run_id,
            replica_id="survivor",
            tasks={"lease_seconds": 30},
        )
        stop = asyncio.Event()
        ready = asyncio.Event()
        server = asyncio.create_task(serve_inference(settings, ready=ready, stop=stop))
        await wait_for(lambda: _completed(queue, 1), 120)
        stop.set()
        await server
        entries = await redis.xrange(queue.rollout_stream)
        await redis.aclose()
        return entries

    entries = asyncio.run(asyncio.wait_for(main(), 240))
    rollouts = [decode_rollout(fields[b"r"]) for _, fields in entries]
    assert len(rollouts) == group
    assert sorted(r.sample_index for r in rollouts) == list(range(group))
    assert {r.replica_id for r in rollouts} == {"survivor"}


async def _owned_by(redis, queue: WorkQueue, task_id: str, replica: bytes) -> bool:
    return await redis.hget(queue.keys["owners"], task_id) == replica


def test_rewards_run_where_replicas_run_them(tmp_path, tiny_model_dir, redis_server, run_id):
    """On the engine thread of a running replica: math-verify scores a right answer 1.0 (its own
    time limit, signal.alarm, cannot work there), a plug-in reward loaded by path scores, and a
    reward that hangs or raises is called again (`reward_retries`, 2), every failed call counted, and
    never scored 0: its group of one scored nothing and is dead-lettered (`reward_failed`) while the
    replica goes on."""
    from prometheus_client import REGISTRY

    from shared.tasks import RewardRunner

    prompts = prompts_of(2)
    engine = make_engine("torch", str(tiny_model_dir), "float32")
    greedy = [
        char_tokenizer().decode(s.token_ids, skip_special_tokens=True)
        for s in engine.generate(prompts, Sampling(temperature=0, max_new_tokens=6))
    ]
    assert RewardRunner().score("math_verify", [greedy[0]], greedy[0])[0].value == 1.0  # what the replica should get

    def failures(reward, reason):
        return (
            REGISTRY.get_sample_value("steadyrl_inference_reward_failures_total", {"reward": reward, "reason": reason})
            or 0.0
        )

    before = {r: failures(f"tests.rewards:{r}", reason) for r, reason in (("hang", "timeout"), ("explode", "error"))}
    tasks = [
        ("right", "math_verify", prompts[0], greedy[0]),
        ("wrong", "math_verify", prompts[0], greedy[0] + "1"),
        ("plugin", "tests.rewards:length", prompts[1], "-"),
        ("hang", "tests.rewards:hang", prompts[1], "-"),
        ("explode", "tests.rewards:explode", prompts[1], "-"),
        ("after", "math_verify", prompts[1], greedy[1]),
    ]

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        async with Replica(
            tmp_path,
            tiny_model_dir,
            redis_server.url,
            run_id,
            tasks={"reward_timeout_seconds": 2, "per_batch": 1},
            plugins=sorted({reward for _, reward, _, _ in tasks if ":" in reward}),  # as the recipe would declare
        ) as replica:
            for name, reward, prompt, answer in tasks:
                task = arith_task(name, prompt, answer, 1)
                task.task_name = reward
                task.sampling.temperature = 0
                task.sampling.max_new_tokens = 6
                await submit(queue, task)
            await wait_for(lambda: _completed(queue, len(tasks) - 2), 120)
            await wait_for(lambda: _dead(queue, 2), 120)
            alive = (await replica.stub.Status(common_pb2.Empty())).replica_id
            entries = await redis.xrange(queue.rollout_stream)
            dead = await redis.hgetall(queue.run_keys.dead_counts)
        await redis.aclose()
        return alive, entries, dead

    alive, entries, dead = asyncio.run(asyncio.wait_for(main(), 240))
    rewards = {decode_rollout(f[b"r"]).task_id: decode_rollout(f[b"r"]).reward for _, f in entries}
    assert alive == "replica-a"
    assert rewards == {
        "right": 1.0,
        "wrong": 0.0,
        "plugin": float(len(greedy[1])),
        "after": 1.0,
    }
    assert dead == {b"reward_failed": b"2"}
    assert failures("tests.rewards:hang", "timeout") == before["hang"] + 3  # the call and its 2 retries
    assert failures("tests.rewards:explode", "error") == before["explode"] + 3


def test_a_dead_engine_stops_the_replica_and_its_tasks_go_back(tmp_path, tiny_model_dir, redis_server, run_id):
    """The engine thread dies mid-task: the task is handed back (not lost, not published) and the
    rollout loop stops the replica (LoopDied: NOT_SERVING, exit for the supervisor)."""
    from shared.runtime.service_main import LoopDied

    class Crash(BaseException):  # not an Exception: nothing on the way catches it
        pass

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        engine = make_engine("torch", str(tiny_model_dir), "float32")
        decode = engine._decode

        def dying(*args):
            if engine.steps >= 3:
                raise Crash("the engine thread fell over")
            return decode(*args)

        engine._decode = dying
        settings = InferenceSettings(
            port=free_port(),
            metrics_port=0,
            model_path=str(tiny_model_dir),
            dtype="float32",
            redis_url=redis_server.url,
            run_id=run_id,
            replica_id="fragile",
            tasks={"lease_seconds": 30},
        )
        task = arith_task("doomed", prompts_of(1)[0], "0", 4)
        task.sampling.max_new_tokens = 20
        task.sampling.ignore_eos = True
        await submit(queue, task)
        stop = asyncio.Event()
        ready = asyncio.Event()
        server = asyncio.create_task(serve_inference(settings, engine, ready=ready, stop=stop))
        with pytest.raises(LoopDied, match="engine died"):
            await asyncio.wait_for(server, 60)
        requeued = await queue.requeue_expired(max_attempts=3)  # the orchestrator's sweep
        depths = await queue.depths()
        reason = await redis.hget(queue._k("errors")[0], "doomed")
        await redis.aclose()
        return requeued, depths, reason, engine.error

    requeued, depths, reason, error = asyncio.run(main())
    assert isinstance(error, BaseException) and "fell over" in str(error)
    assert requeued == (1, 0) and depths.rollouts == 0 and depths.pending == 1  # back in the queue, not lost
    assert b"handed back" in reason


def test_a_replica_scaled_down_mid_task_hands_its_leases_back_at_once(tmp_path, tiny_model_dir, redis_server, run_id):
    """What a scale-down does (SIGTERM, as Kubernetes and KEDA send it): the replica stops, hands
    back the tasks it was generating without waiting for their leases to expire, and exits 0."""
    prompt = prompts_of(1)[0]
    env = replica_env(tiny_model_dir, redis_server.url, run_id, "scaled-down", 600)

    async def main():
        redis = Redis.from_url(redis_server.url)
        queue = WorkQueue(redis, run_id)
        task = arith_task("long", prompt, "0", 512)
        task.sampling.max_new_tokens = 48
        task.sampling.ignore_eos = True  # a long generation to stop in
        await submit(queue, task)
        replica = subprocess.Popen([sys.executable, "-m", "services.inference"], env=env)
        try:
            await wait_for(lambda: _owned_by(redis, queue, "long", b"scaled-down"), 90)
            replica.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(replica.wait, 30)
        finally:
            if replica.poll() is None:
                replica.kill()
        reason = await redis.hget(queue._k("errors")[0], "long")
        swept = await queue.requeue_expired(max_attempts=3)  # the orchestrator's next sweep
        depths = await queue.depths()
        await redis.aclose()
        return code, swept, depths, reason

    code, swept, depths, reason = asyncio.run(asyncio.wait_for(main(), 180))
    assert code == 0
    assert swept == (1, 0)  # its lease ended with the replica, not 600 s later
    assert depths.pending == 1 and depths.leased == 0 and depths.rollouts == 0
    assert b"handed back: the replica stopped" in reason
