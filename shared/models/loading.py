"""Load causal LMs and tokenizers from local Hugging Face directories (never from a hub)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

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


def _local_dir(path: str | os.PathLike) -> Path:
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} is not a local Hugging Face model directory (no config.json)")
    return directory


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

    model = AutoModelForCausalLM.from_pretrained(_local_dir(path), dtype=resolve_dtype(dtype), local_files_only=True)
    return model.to(device).eval()


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_local_dir(path), local_files_only=True)


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


def encode_prompts(tokenizer, texts: list[str], chat: bool = False, system_prompt: str = "") -> list[list[int]]:
    """`encode_prompt` of each text; raw texts in one batch call of the tokenizer."""
    if chat and getattr(tokenizer, "chat_template", None):
        return [encode_prompt(tokenizer, t, chat, system_prompt) for t in texts]
    if not texts:
        return []
    bos = tokenizer.bos_token_id
    out = []
    for ids in tokenizer(texts, add_special_tokens=True).input_ids:
        ids = list(ids)
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        out.append(ids)
    return out


def encode_prompt(tokenizer, text: str, chat: bool = False, system_prompt: str = "") -> list[int]:
    """Token ids of a prompt: with `chat` and a tokenizer that has a chat template, the template's
    rendering of (system prompt,) the user's message and the assistant's turn opening; else the
    raw text, starting with the BOS token when the tokenizer has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": text}
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding (transformers 5 returns a dict by default)
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    ids = list(tokenizer(text, add_special_tokens=True).input_ids)
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids
