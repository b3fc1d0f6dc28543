"""Settings of the weight-sync service (env prefix STEADYRL_WEIGHTSYNC_)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from shared.runstore.redis_client import RedisSettings
from shared.runtime.settings import ApiServiceSettings, VerifiedWeights


class WeightSyncSettings(ApiServiceSettings, RedisSettings, VerifiedWeights):
    """Weight-sync reads one thing from the run's Redis: the run's instance, which every version it
    takes must carry (set `redis_url`, or `run_instance` itself; docs/security.md)."""

    model_config = SettingsConfigDict(env_prefix="STEADYRL_WEIGHTSYNC_", extra="forbid")

    run_id: str = ""
    """The run it serves ([run] id): the `run` label on its metrics (empty: none)."""
    port: int = Field(50051, ge=0, le=65535)
    """gRPC port (0 = any free port)."""
    metrics_port: int = Field(9101, ge=0, le=65535)
    """Prometheus /metrics port (0 = any free port)."""
    retain_versions: int = Field(4, ge=1)
    """Versions kept in all (the oldest is dropped beyond this)."""
    memory_versions: int = Field(2, ge=1)
    """Versions held in memory at most, the one arriving included (older ones are spilled to disk:
    written ahead as soon as a version is held, let go of when the next one arrives): peak memory ≈
    memory_versions × one version's bytes (2 × 61 GB for Qwen3-30B-A3B in bf16)."""
    spill_dir: Path = Path("/tmp/steadyrl-weightsync")
    """Where spilled versions are written."""
    chunk_bytes: int = Field(1024 * 1024, ge=1024)
    """Bytes per TensorChunk on Pull."""
    max_version_bytes: int = Field(256 * 1024**3, ge=1)
    """Largest total size of one version (a bigger manifest is refused before any byte)."""
    shm_dir: Path = Path("/dev/shm/steadyrl")
    """Versions announced through shared memory must be files under this directory (same host)."""
    collective_timeout_seconds: float = Field(60.0, gt=0)
    """Bound on forming a collective group and on one broadcast; a member slower than this leaves."""
    bucket_bytes: int = Field(256 * 1024 * 1024, ge=64 * 1024)
    """Bytes per broadcast bucket."""

    @model_validator(mode="after")
    def _chunks_fit_messages(self) -> WeightSyncSettings:
        if self.chunk_bytes + 4096 > self.max_message_bytes:
            raise ValueError("chunk_bytes must leave room for the message envelope within max_message_bytes")
        self._needs_key("weight-sync")
        return self
