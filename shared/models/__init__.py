"""Hugging Face model loading, MoE routing capture/replay (R2/R3), fp8/fp4 emulation, LoRA (the
tiny-model kit is `shared.kit`)."""

from shared.models.loading import decode_completions, load_causal_lm, load_tokenizer, resolve_dtype
from shared.models.routing import NotMoEError, Recording, RoutingController

__all__ = [
    "NotMoEError",
    "Recording",
    "RoutingController",
    "decode_completions",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_dtype",
]
