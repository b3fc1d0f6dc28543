"""JSON Lines files a run leaves (metrics.jsonl, eval.jsonl, ...), read back."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path | None) -> list[dict]:
    """Every record of a JSON Lines file; [] when there is none (no path, no file)."""
    if path is None or not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
