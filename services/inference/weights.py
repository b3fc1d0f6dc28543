"""A replica's weights: the subscriber that watches weight-sync (`shared.weightsync.subscriber`),
checks each version against the trainer's signature, and applies it to the engine off the event
loop, counting the pause."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.inference.config import InferenceSettings
from services.inference.metrics import POLICY_VERSION, SWAP_SECONDS
from shared.engines import Engine
from shared.runstore.run_instance import resolve_instance
from shared.weightsync.base import kind
from shared.weightsync.signing import verifier_of

log = logging.getLogger("steadyrl.inference")


def weights_loop(
    settings: InferenceSettings,
    engine: Engine,
    stop: asyncio.Event,
    applied: Callable[[], Awaitable[None]] | None = None,
):
    """The loop that keeps `engine` on the trainer's newest version; `applied()` after each one
    lands (tasks waiting for it start at once)."""
    from shared.weightsync.subscriber import WatchSubscriber

    replica = settings.replica_id

    async def apply(delivery) -> float:
        try:
            seconds = await asyncio.to_thread(engine.apply, delivery)
        finally:
            if applied is not None:
                await applied()
        POLICY_VERSION.labels(replica, settings.pool).set(engine.version)
        SWAP_SECONDS.labels(replica).observe(seconds)
        log.info(
            "event=weights_applied version=%d transport=%s kind=%s paused_seconds=%.4f",
            delivery.version,
            delivery.transport,
            kind(delivery.manifest),
            seconds,
        )
        return seconds

    subscriber = WatchSubscriber(
        settings.weightsync_address,
        apply,
        replica,
        settings.max_message_bytes,
        transports=settings.weight_transports,
        base=engine.weight_bytes,
        version=engine.version,
        verifier=verifier_of(settings, settings.run_id),
        patchable=getattr(engine, "takes_patch", None),  # vLLM: its workers say; the torch engine: its bytes
    )

    async def watch() -> None:
        if subscriber.verifier is not None:  # versions of another instance of the run are refused
            client = settings.redis()
            try:
                subscriber.verifier.instance = await resolve_instance(settings, client)
            finally:
                await client.aclose()
        await subscriber.run(stop)

    return watch()
