"""vLLM worker extension: methods mixed into every vLLM worker, called by name through
`collective_rpc`. Importing it (vLLM does, in each worker, before the model loads) registers the
`steadyrl` weight-transfer backend the weights take (`shared.weightsync.vllm`)."""

from __future__ import annotations

from shared.weightsync.vllm import register

register()


class WorkerExtension:
    def steadyrl_update_status(self) -> dict:
        """What the last weight update did in this worker (`shared.weightsync.vllm.Status`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return engine.status.as_dict() if engine is not None and hasattr(engine, "status") else {}
