"""Orchestrator: owns a run: the work queue, admission by staleness budget, evals, the control plane."""
