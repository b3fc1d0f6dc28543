"""vLLM worker extension: methods mixed into every vLLM worker, called by name through
`LLM.collective_rpc`. Weights travel as a safetensors file path (vLLM 0.32 refuses tensors as
RPC arguments)."""

from __future__ import annotations


class WeightLoader:
    def load_weights_from_file(self, path: str) -> int:
        """Reload the model in place from a safetensors file in checkpoint layout (HF names).

        vLLM's in-place reload re-runs each layer's post-load processing (repacked kernels, fused
        experts), which a bare `model.load_weights` would skip. Returns the tensors read."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)
