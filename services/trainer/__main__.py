"""`python -m services.trainer`: run the trainer (settings from STEADYRL_TRAINER_*)."""

from services.trainer.config import TrainerSettings
from shared.runtime.service_main import run_service

if __name__ == "__main__":
    run_service("trainer", TrainerSettings, "services.trainer.server")
