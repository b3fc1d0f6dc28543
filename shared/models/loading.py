"""Load causal LMs and tokenizers from local Hugging Face directories (never from a hub)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shared.tasks.prompt_tokenizer import (  # noqa: F401 - where callers find them
    encode_prompt,
    encode_prompts,
    load_tokenizer,
    local_model_dir,
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def wait_for_model(path: str | os.PathLike, seconds: float, log=None, every: float = 30.0) -> None:
    """Return once `path` holds a model (its config.json), waiting at most `seconds`: a deployment's
    job may still be writing it. `log(waited)` every `every` seconds; past the bound FileNotFoundError."""
    import time

    started = time.monotonic()
    told = started
    while not (Path(path) / "config.json").is_file():
        now = time.monotonic()
        if now - started >= seconds:
            raise FileNotFoundError(f"{path}: no model (config.json) within {seconds:g} s")
        if log is not None and now - told >= every:
            log(round(now - started))
            told = now
        time.sleep(max(0.05, min(1.0, every, seconds - (now - started))))


def load_causal_lm(path: str | os.PathLike, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """A transformers causal LM from a local directory, in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        local_model_dir(path), dtype=resolve_dtype(dtype), local_files_only=True
    )
    return model.to(device).eval()


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def copy_tokenizer_files(model_path: str | os.PathLike, target: Path) -> None:
    """The base model's tokenizer and generation files beside weights saved to `target` (an exported model)."""
    import shutil

    for name in TOKENIZER_FILES:
        source = Path(model_path) / name
        if source.exists() and not (target / name).exists():
            shutil.copy(source, target / name)


def decode_completions(tokenizer, token_ids: list[list[int]]) -> list[str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` of each, in one call to a fast tokenizer's
    backend when the wrapper would add nothing to it (no clean-up of spaces)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode_batch([list(ids) for ids in token_ids], skip_special_tokens=True)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in token_ids]
