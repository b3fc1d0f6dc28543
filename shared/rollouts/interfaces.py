"""The transports between the services, as interfaces: what a service needs of each, not how it
travels.

- `RolloutSink` (replicas publish): `shared.runstore.queues.WorkQueue` (Redis, Lua).
- `RolloutSource` (the trainer reads): `services.trainer.stream.RedisRolloutSource`.
- `WeightPublisher` / `WeightSubscriber` / `Delivery` (the trainer pushes, replicas receive):
  `shared.weightsync.base`, one module per transport.
- `Engine` (replicas generate): `shared.engines` torch / vllm (a Protocol there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class RolloutSink(ABC):
    """Where a replica publishes a finished task: all its rollouts and the end of its lease as
    one step, refused when the lease was lost (so each task is published once)."""

    @abstractmethod
    async def complete_many(
        self, replica_id: str, done: list[tuple[str, list[bytes]]], evals: set[str] = frozenset()
    ) -> list[bool]:
        """Per task (task id, encoded rollouts): published, or False when the lease was lost."""


class RolloutSource(ABC):
    """Where the trainer reads rollouts, at least once, and settles each exactly once: trained
    (into the ledger), a duplicate, dropped as stale, filtered, or dead-lettered with a reason."""

    @abstractmethod
    async def open(self) -> None:
        """Join the stream (idempotent)."""

    @abstractmethod
    async def read(self, block_ms: int, count: int = 512) -> list:
        """New entries, [(entry id, fields)]; waits at most `block_ms`."""

    @abstractmethod
    async def claim(self, start: bytes | str = "0-0", count: int = 512) -> tuple[bytes | str, list]:
        """A page of entries delivered before but never settled: (next start, entries)."""

    @abstractmethod
    async def stamps(self, entries: list) -> dict[str, str | None]:
        """The lease that completed each task these entries name."""

    @abstractmethod
    async def trained(self, items: list[tuple[bytes | str, str]]) -> int:
        """Settle (entry id, rollout id) pairs as trained; returns how many ids were new to the ledger."""

    @abstractmethod
    async def duplicates(self, items: list[tuple[bytes, str]]) -> None: ...

    @abstractmethod
    async def dropped(self, items: list[tuple[bytes | str, str]]) -> int: ...

    @abstractmethod
    async def filtered(self, items: list[tuple[bytes | str, str]]) -> int:
        """Settle the entries of a group dynamic sampling filtered (equal rewards); returns the new ids."""

    @abstractmethod
    async def dead_letter(self, entry: bytes, reason: str, message: str, payload: bytes, group: str = "") -> None:
        """Give up an entry with its reason; `group`: the group it poisons ('' for none)."""

    @abstractmethod
    async def dead_groups(self) -> set[str]: ...

    @abstractmethod
    async def identity(self) -> str:
        """Which server instance answers: a change means it restarted and may have lost writes."""
