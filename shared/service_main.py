"""The entry point every service shares: settings from the environment, logging, and a serve()
that stops cleanly on SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import importlib
import signal

from shared.logs import setup_logging


def run_service(name: str, settings_cls: type, server_module: str) -> None:
    """Build `settings_cls()` from STEADYRL_* variables and run `server_module.serve` until a signal."""
    settings = settings_cls()
    setup_logging(name)

    async def run() -> None:
        serve = importlib.import_module(server_module).serve
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop=stop)

    asyncio.run(run())
