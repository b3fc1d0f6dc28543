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

    def parameter_sums(self) -> dict[str, float]:
        """Sum of every parameter and buffer of the worker's model, by name: a cheap fingerprint to
        compare a replica's loaded weights before and after an update."""
        model = self.model_runner.model
        out = {f"param:{n}": float(p.detach().double().sum()) for n, p in model.named_parameters()}
        out.update({f"buffer:{n}": float(b.detach().double().sum()) for n, b in model.named_buffers()})
        return out
