"""Prompt text to token ids, for the services that never compute (the orchestrator): a model
directory whose tokenizer.json is the whole tokenizer (a generic fast tokenizer, no chat template,
no setting transformers would apply on top) is read by the `tokenizers` library alone, in
milliseconds and without importing torch; any other goes through transformers' AutoTokenizer
(`load_tokenizer`, which the services that compute load as well).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
PLAIN_KEYS = {  # tokenizer_config.json keys that change nothing in how a text is encoded
    "backend",
    "tokenizer_class",
    "bos_token",
    "eos_token",
    "pad_token",
    "unk_token",
    "model_max_length",
    "added_tokens_decoder",
    "clean_up_tokenization_spaces",
}


class TokenizerJson:
    """tokenizer.json through `tokenizers`, with the part of transformers' interface the orchestrator's
    tasks use: `tokenizer(texts, add_special_tokens=True).input_ids`, decode, bos_token_id, chat_template."""

    chat_template = None

    def __init__(self, directory: Path, config: dict) -> None:
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.bos_token_id = self.token_id(config.get("bos_token"))
        self.eos_token_id = self.token_id(config.get("eos_token"))
        self.pad_token_id = self.token_id(config.get("pad_token"))

    def token_id(self, token: str | dict | None) -> int | None:
        text = token.get("content") if isinstance(token, dict) else token
        return self.backend.token_to_id(text) if text else None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (no clean-up of spaces: a config asking for it takes transformers' path)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __call__(self, texts: str | list[str], add_special_tokens: bool = True) -> SimpleNamespace:
        batch = [texts] if isinstance(texts, str) else list(texts)
        ids = [e.ids for e in self.backend.encode_batch(batch, add_special_tokens=add_special_tokens)]
        return SimpleNamespace(input_ids=ids[0] if isinstance(texts, str) else ids)


def plain_tokenizer_config(directory: Path) -> dict | None:
    """The directory's tokenizer_config.json when tokenizer.json alone encodes as transformers would;
    None when transformers must (a chat template, a tokenizer class of its own, any other setting)."""
    if not (directory / "tokenizer.json").is_file() or (directory / "chat_template.jinja").exists():
        return None
    path = directory / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        return None  # transformers reads it and says what is wrong
    if not isinstance(config, dict) or set(config) - PLAIN_KEYS or config.get("clean_up_tokenization_spaces"):
        return None
    return config if config.get("tokenizer_class", "PreTrainedTokenizerFast") in GENERIC_CLASSES else None


def load_prompt_tokenizer(path: str | os.PathLike):
    """The tokenizer that turns prompts into ids: TokenizerJson where that is exact, else transformers'."""
    directory = Path(path)
    config = plain_tokenizer_config(directory) if (directory / "config.json").is_file() else None
    if config is not None:
        return TokenizerJson(directory, config)
    return load_tokenizer(path)


def local_model_dir(path: str | os.PathLike) -> Path:
    """`path` as a local Hugging Face model directory (its config.json there), else FileNotFoundError."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} is not a local Hugging Face model directory (no config.json)")
    return directory


def load_tokenizer(path: str | os.PathLike):
    """transformers' tokenizer of a local model directory (never from a hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_model_dir(path), local_files_only=True)


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
