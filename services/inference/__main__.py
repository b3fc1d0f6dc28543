"""`python -m services.inference`: run an inference replica (settings from STEADYRL_INFERENCE_*)."""

import asyncio
import signal

from services.inference.config import InferenceSettings
from shared.logs import setup_logging


async def _run(settings: InferenceSettings) -> None:
    from services.inference.server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop=stop)


def main() -> None:
    settings = InferenceSettings()
    setup_logging("inference")
    asyncio.run(_run(settings))


if __name__ == "__main__":  # vLLM spawns processes: the engine is built only under this guard
    main()
