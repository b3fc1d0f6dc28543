"""Trainer service: version-aware MiniRL over the rollout stream, with routing replay."""
