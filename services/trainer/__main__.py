"""`python -m services.trainer`: run the trainer (settings from STEADYRL_TRAINER_*)."""

import asyncio
import signal

from services.trainer.config import TrainerSettings
from shared.logs import setup_logging


async def _run(settings: TrainerSettings) -> None:
    from services.trainer.server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop=stop)


def main() -> None:
    settings = TrainerSettings()
    setup_logging("trainer")
    asyncio.run(_run(settings))


if __name__ == "__main__":
    main()
