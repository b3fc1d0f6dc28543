"""`python -m services.orchestrator`: run the orchestrator (settings from STEADYRL_ORCHESTRATOR_*)."""

from services.orchestrator.config import OrchestratorSettings
from shared.runtime.service_main import run_service

if __name__ == "__main__":
    run_service("orchestrator", OrchestratorSettings, "services.orchestrator.server")
