"""A reward model: a sequence-classification model (transformers' AutoModelForSequenceClassification)
that returns one scalar per text, served by a judge pool's replica for `reward_model:` rewards.
One label: its logit; two: the probability of label 1; more: refused (no single scalar).

Details: docs/guides/pools.md"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from shared.models.loading import encode_prompt, load_tokenizer, resolve_dtype
from shared.runtime.torch_threads import bind_torch_threads


def is_classifier(model_path: str | Path) -> bool:
    """Whether the model directory holds a sequence-classification model (its config's architecture)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    architectures = json.loads(config.read_text()).get("architectures") or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


class SequenceClassifier:
    """Scores texts with a fixed reward model; thread-safe (one forward at a time)."""

    name = "classifier"

    def __init__(self, model_path: str, dtype: str = "float32", threads: int = 1, max_length: int = 0) -> None:
        from transformers import AutoModelForSequenceClassification

        self.model_path = str(model_path)
        self.threads = threads
        self.tokenizer = load_tokenizer(self.model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.model_path, dtype=resolve_dtype("float32" if dtype == "auto" else dtype), local_files_only=True
        ).eval()
        labels = self.model.config.num_labels
        if labels not in (1, 2):
            raise ValueError(f"{self.model_path}: a reward model has 1 or 2 labels, this one {labels}")
        pad = self.tokenizer.pad_token_id
        if pad is None:
            raise ValueError(f"{self.model_path}: the reward model's tokenizer has no pad token")
        self.model.config.pad_token_id = pad
        self.max_length = max_length or int(getattr(self.model.config, "max_position_embeddings", 0) or 4096)
        self._lock = threading.Lock()

    def scores(self, texts: list[str], batch: int = 64) -> list[float]:
        """One scalar per text; ValueError for a text longer than the model's positions."""
        encoded = [encode_prompt(self.tokenizer, text) for text in texts]
        for i, ids in enumerate(encoded):
            if not ids or len(ids) > self.max_length:
                raise ValueError(f"text {i}: {len(ids)} tokens; the reward model reads 1 to {self.max_length}")
        out: list[float] = []
        with self._lock, torch.inference_mode():
            bind_torch_threads(self.threads)
            for start in range(0, len(encoded), batch):
                chunk = encoded[start : start + batch]
                width = max(map(len, chunk))
                ids = torch.full((len(chunk), width), self.model.config.pad_token_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for row, tokens in enumerate(chunk):
                    ids[row, : len(tokens)] = torch.tensor(tokens)
                    mask[row, : len(tokens)] = 1
                logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
                values = logits[:, 0] if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)[:, 1]
                out += values.tolist()
        return out
