"""`python -m services.weightsync`: run the weight-sync service (settings from STEADYRL_WEIGHTSYNC_*)."""

from services.weightsync.config import WeightSyncSettings
from shared.runtime.service_main import run_service

if __name__ == "__main__":
    run_service("weightsync", WeightSyncSettings, "services.weightsync.server")
