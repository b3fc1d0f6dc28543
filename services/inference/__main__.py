"""`python -m services.inference`: run an inference replica (settings from STEADYRL_INFERENCE_*)."""

from services.inference.config import InferenceSettings
from shared.runtime.service_main import run_service

if __name__ == "__main__":  # vLLM spawns processes: the engine is built only under this guard
    run_service("inference", InferenceSettings, "services.inference.server")
