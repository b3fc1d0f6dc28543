"""The reference engine: a transformers causal LM, batched sampling with a KV cache.

Prompts are left-padded into one batch. Each decode step runs under the engine lock and applies a
staged weight update first, so a switch lands between two steps, atomically, and every token
records the version that produced it. Routing traces come from capturing the routers during the
same forwards that sample (prefill + each decode step), so they are exactly what generated the
tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.engines.base import (
    Capabilities,
    OnStep,
    Sample,
    Sampling,
    StagedWeights,
    processed_logprobs,
)
from shared.models import load_causal_lm
from shared.models.loading import resolve_dtype
from shared.models.routing import RoutingController
from shared.torch_threads import bind_torch_threads


class TorchEngine(StagedWeights):
    name = "torch"

    def __init__(self, model_path: str, dtype: str = "float32", version: int = 0, threads: int = 0) -> None:
        self.threads = threads
        bind_torch_threads(threads)
        self.model_path = str(model_path)
        self.dtype = resolve_dtype(dtype)
        self.model = load_causal_lm(model_path, self.dtype).eval()
        self.routing = RoutingController(self.model)
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(getattr(config, "max_position_embeddings", 4096))
        eos = config.eos_token_id
        self.eos_token_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
        self.pad_token_id = int(getattr(config, "pad_token_id", None) or 0)
        self.capabilities = Capabilities(routing_trace=self.routing.is_moe, dtype=str(self.dtype).removeprefix("torch."))
        self._init_weights(version)

    @torch.no_grad()
    def _load(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise KeyError(f"weights of version {version} do not fit the model: "
                           f"missing {missing[:3]}, unexpected {unexpected[:3]}")

    def _forward(self, **inputs):
        bind_torch_threads(self.threads)  # the thread that runs the model, whichever it is
        with self._serving():
            version = self._version
            out = self.model(**inputs, use_cache=True)
        return out, version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling, return_trace: bool = False,
                 on_step: OnStep | None = None) -> list[Sample]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if return_trace and not self.capabilities.routing_trace:
            raise ValueError("this model has no MoE router: no routing trace to return")
        batch, width = len(prompts), max(map(len, prompts))
        if width + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({width}) + max_new_tokens ({sampling.max_new_tokens}) > {self.max_model_len}")
        pads = torch.tensor([width - len(p) for p in prompts])
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts])
        attention = (torch.arange(width)[None, :] >= pads[:, None]).long()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed else None
        stops = torch.tensor(sorted({*self.eos_token_ids, *sampling.stop_token_ids}), dtype=torch.long)
        tokens = torch.zeros(batch, sampling.max_new_tokens, dtype=torch.long)
        logprobs = torch.zeros(batch, sampling.max_new_tokens)
        versions = torch.zeros(batch, sampling.max_new_tokens, dtype=torch.long)
        lengths = torch.full((batch,), sampling.max_new_tokens)
        done = torch.zeros(batch, dtype=torch.bool)
        capture = self.routing.capture() if return_trace else None
        recording = capture.__enter__() if capture is not None else None
        try:
            out, version = self._forward(input_ids=input_ids, attention_mask=attention, position_ids=positions)
            for step in range(sampling.max_new_tokens):
                logp = processed_logprobs(out.logits[:, -1, :], sampling)
                if sampling.temperature > 0:
                    chosen = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
                else:
                    chosen = logp.argmax(-1)
                chosen = torch.where(done, self.pad_token_id, chosen)
                tokens[:, step] = chosen
                logprobs[:, step] = logp.gather(-1, chosen[:, None]).squeeze(-1)
                versions[:, step] = version
                if on_step is not None:
                    live = [None if d else int(t) for d, t in zip(done.tolist(), chosen.tolist(), strict=True)]
                    on_step(step, live, logprobs[:, step].tolist(), version)
                ended = ~done & torch.isin(chosen, stops)
                lengths = torch.where(ended, step + 1, lengths)
                done |= ended
                if bool(done.all()) or step + 1 == sampling.max_new_tokens:
                    break
                attention = torch.cat([attention, torch.ones(batch, 1, dtype=attention.dtype)], dim=1)
                positions = positions[:, -1:] + 1
                out, version = self._forward(input_ids=chosen[:, None], attention_mask=attention,
                                             position_ids=positions, past_key_values=out.past_key_values)
        finally:
            if capture is not None:
                capture.__exit__(None, None, None)
        samples = []
        for row in range(batch):
            count = int(lengths[row])
            samples.append(Sample(
                token_ids=tokens[row, :count].tolist(),
                logprobs=logprobs[row, :count].tolist(),
                versions=versions[row, :count].tolist(),
                finish_reason="stop" if bool(done[row]) else "length",
            ))
        if recording is not None:
            self._attach_traces(samples, recording, pads, width)
        return samples

    def _attach_traces(self, samples: list[Sample], recording, pads: torch.Tensor, width: int) -> None:
        """Trace of each sample: its prompt positions from the prefill, then one position per
        generated token that was fed back (all but the last): P + C − 1 positions."""
        prefill = torch.stack(recording.calls[0], dim=1)  # [B * width, L, K]
        prefill = prefill.reshape(len(samples), width, *prefill.shape[1:])
        steps = [torch.stack(call, dim=1) for call in recording.calls[1:]]  # each [B, L, K]
        wide = self.routing.num_experts > 256
        for row, sample in enumerate(samples):
            parts = [prefill[row, int(pads[row]):], *(s[row : row + 1] for s in steps[: len(sample.token_ids) - 1])]
            trace = torch.cat(parts, dim=0).numpy()
            sample.routing_trace = trace.astype(np.uint16 if wide else np.uint8)
            sample.num_experts = self.routing.num_experts

    def close(self) -> None:
        self.routing.close()

