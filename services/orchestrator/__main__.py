"""`python -m services.orchestrator`: run the orchestrator (settings from STEADYRL_ORCHESTRATOR_*)."""

import asyncio
import signal

from services.orchestrator.config import OrchestratorSettings
from shared.logs import setup_logging


async def _run(settings: OrchestratorSettings) -> None:
    from services.orchestrator.server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop=stop)


def main() -> None:
    settings = OrchestratorSettings()
    setup_logging("orchestrator")
    asyncio.run(_run(settings))


if __name__ == "__main__":
    main()
