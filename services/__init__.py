"""steadyrl services: inference, trainer, weightsync, orchestrator (thin layers over shared)."""
