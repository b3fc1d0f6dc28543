"""`python -m services.weightsync`: run the weight-sync service (settings from STEADYRL_WEIGHTSYNC_*)."""

import asyncio

from services.weightsync.config import WeightSyncSettings
from shared.logs import setup_logging


def main() -> None:
    settings = WeightSyncSettings()
    setup_logging("weightsync")
    from services.weightsync.server import serve

    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
