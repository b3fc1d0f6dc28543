"""Inference service: engines, the rollout worker loop and the Inference gRPC API."""
