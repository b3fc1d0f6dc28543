"""The trainer's weight publishing: each version signed with the run's key and sent to the weight-sync service,
never twice under one number.

A version's number is recorded in Redis (`trainer.published_version`) before it is pushed, so a restarted trainer
numbers past it (`newest_published`). A failed or refused push is not fatal and never counts as published: it is
logged and counted with its gRPC code and retried on the next turn, and a newer version supersedes it.

Details: docs/internals/trainer.md"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping

import grpc
import torch
from prometheus_client import Counter
from redis.asyncio import Redis

from services.trainer.config import TrainerSettings
from shared.runstore.keys import RunKeys, TrainerField
from shared.runstore.run_instance import resolve_instance

log = logging.getLogger("steadyrl.trainer")
PUBLISH_FAILURES = Counter("steadyrl_trainer_publish_failures_total", "Version pushes that failed", ["code"])


async def _sent() -> None:
    """Nothing left to send (no weight-sync service: a version is out once made)."""


class VersionPublisher:
    def __init__(self, settings: TrainerSettings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = RunKeys(settings.run_id)
        self.client = None  # a shared.weightsync publisher of the configured transport, made in the event loop
        self.published = 0  # the newest version pushed by this process (or found published)
        self.instance = settings.run_instance  # the run's instance, signed into each version (`resume`)

    @property
    def enabled(self) -> bool:
        return bool(self.settings.weightsync_address)

    async def newest_published(self) -> int:
        """The newest version any replica may hold: the larger of the number recorded before each
        push and the weight-sync service's latest (0 when neither is known)."""
        recorded = await self.redis.hget(self.keys.trainer, TrainerField.PUBLISHED_VERSION)
        newest = int(recorded or 0)
        if self.enabled:
            from shared.weightsync.grpc import latest_version

            try:
                newest = max(
                    newest,
                    await asyncio.wait_for(
                        latest_version(self.settings.weightsync_address), self.settings.publish.timeout_seconds
                    ),
                )
            except (TimeoutError, grpc.aio.AioRpcError) as exc:
                log.warning("event=weightsync_latest_unknown error=%s", type(exc).__name__)
        return newest

    async def held_by_weightsync(self) -> bool:
        """Whether weight-sync still holds the newest version pushed. A weight-sync service that
        restarted (its memory lost) may not: then `published` falls back to what it holds, so the
        trainer pushes its current weights again, and replicas waiting for that version get it.
        True when weight-sync cannot be asked (the next check asks again)."""
        from shared.weightsync.grpc import latest_version

        try:
            latest = await asyncio.wait_for(latest_version(self.settings.weightsync_address), 5.0)
        except (TimeoutError, grpc.aio.AioRpcError):
            return True
        if latest >= self.published:
            return True
        log.warning("event=weightsync_lost_versions latest=%d published=%d: publishing again", latest, self.published)
        self.published = latest
        return False

    async def resume(self, version: int) -> int:
        """The version a (re)started trainer continues from: its checkpoint's `version`, or the
        next number past the newest published one when that is newer (the steps behind it were
        lost with a crash; their numbers are never reused). Learns the run's instance first."""
        if self.enabled:
            self.instance = await resolve_instance(self.settings, self.redis)
        published = await self.newest_published()
        if published > version:
            log.warning(
                "event=version_continues checkpoint_version=%d published=%d version=%d",
                version,
                published,
                published + 1,
            )
            version = published + 1
        self.published = min(published, version) if self.enabled else version
        return version

    async def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> bool:
        """Push `version`; True once the service holds it. False (logged, counted) on failure."""
        return await (await self.stage(weights, version))()

    async def stage(self, weights: Mapping[str, torch.Tensor], version: int) -> Callable[[], Awaitable[bool]]:
        """The part of `publish` that reads the weights (shm: the file written; grpc and collective:
        the whole push); returns its completion (shm: the announcement), awaited later: True once
        the service holds the version, False (logged, counted) on failure."""
        if not self.enabled:
            return functools.partial(self._complete, _sent, version)
        await self.redis.hset(self.keys.trainer, TrainerField.PUBLISHED_VERSION, version)  # before any byte leaves
        if self.client is None:
            from shared.weightsync import make_publisher
            from shared.weightsync.shm_folders import run_folder
            from shared.weightsync.signing import Signer

            s = self.settings
            key = s.publish.signing_key_file
            signer = Signer.from_file(key, s.run_id, self.instance) if key else None
            self.client = make_publisher(
                s.publish.transport,
                s.weightsync_address,
                signer,
                s.max_message_bytes,
                run_folder(s.publish.shm_dir, s.run_id, self.instance),
                s.publish.shm_keep,
                s.publish.patches,
            )
        try:
            complete = await self.client.stage(
                weights, version, self.published, timeout=self.settings.publish.timeout_seconds
            )
        except grpc.aio.AioRpcError as exc:
            self._failed(version, exc)
            return functools.partial(self._complete, None, version)
        finally:
            finish = getattr(weights, "finish", None)  # a sharded model's gather left half-way: the ranks complete it
            if finish is not None:
                await asyncio.to_thread(finish)
        return functools.partial(self._complete, complete, version)

    async def _complete(self, complete: Callable[[], Awaitable] | None, version: int) -> bool:
        """`version` is out once its completion returns (None: its stage failed already)."""
        if complete is None:
            return False
        try:
            await complete()
        except grpc.aio.AioRpcError as exc:
            self._failed(version, exc)
            return False
        self.published = version
        return True

    @staticmethod
    def _failed(version: int, exc: grpc.aio.AioRpcError) -> None:
        PUBLISH_FAILURES.labels(exc.code().name).inc()
        log.warning(
            "event=publish_failed version=%d code=%s detail=%s", version, exc.code().name, (exc.details() or "")[:300]
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
