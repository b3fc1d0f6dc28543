"""The torch engine's model and weights: loaded (with the quantization it emulates), and written
in place by each version — each bucket of a delivery copied into the model's own tensors (cast to
the engine's dtype, moved to its device, re-rounded where the engine emulates a quantization), or
a patched tensor's changed elements written into the bytes of the version it patches — with no
staged copy of the version."""

from __future__ import annotations

import torch

from shared.models import load_causal_lm
from shared.models.lora import adapter_refusal, inject
from shared.models.quantization import QUANTIZATIONS, emulate, quantize_
from shared.weightsync.base import Delivery, PartialVersion
from shared.weightsync.manifest import WeightError, tensor_to_bytes
from shared.weightsync.patches import Patch


def load_model(
    model_path: str,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
    quantize_router: bool,
    quantize_activations: bool,
):
    """(model in eval mode, the tensors quantized, the activation-quantizing context, notes)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    for name, asked in (("quantize_router", quantize_router), ("quantize_activations", quantize_activations)):
        if asked and quantization == "none":  # as InferenceSettings refuses it
            raise ValueError(f'{name} needs a quantization ("fp8" or "fp4")')
    model = load_causal_lm(model_path, dtype, device).eval()
    quantized, activations, notes = emulate(model, quantization, quantize_router, quantize_activations, dtype)
    return model, quantized, activations, notes


class InPlaceWeights:
    """The engine model's tensors, written in place by each version. An adapter version (its
    manifest's `adapter`) is written into peft's LoRA layers, put into the model by the first one
    (`shared.models.lora.inject`): the base stays as loaded, the model computes base + adapter
    exactly as the trainer's did. A full version after adapters zeroes their B (the model is then
    that version alone)."""

    def __init__(self, model: torch.nn.Module, quantized: list[str], quantization: str, model_path: str = "") -> None:
        self.model = model
        self.quantized = set(quantized)
        self.quantization = quantization
        self.model_path = model_path
        self.targets = dict(model.state_dict())  # the base's tensors by their names (kept when LoRA layers come in)
        seen: dict[int, str] = {}
        for name, tensor in self.targets.items():  # tied tensors share storage: one of them suffices
            seen.setdefault(tensor.untyped_storage().data_ptr(), name)
        self.storages = seen
        self.adapter_json = ""  # the adapter config whose layers are in the model, once one came
        self.adapter: dict[str, torch.Tensor] = {}  # its tensors by PEFT's saved names

    @torch.no_grad()
    def copy_in(self, delivery: Delivery) -> None:
        """Every tensor of the version into the model. WeightError before the first copy (nothing
        changed); PartialVersion after it (the model holds neither version)."""
        is_adapter = delivery.manifest.HasField("adapter")
        if is_adapter:
            self._adapt(delivery)
        targets = self.adapter if is_adapter else self.targets
        self._check(delivery, targets)
        copied: set[int] = set()
        try:
            for bucket in delivery.buckets():
                for name, tensor in bucket:
                    target = targets.get(name)
                    if isinstance(tensor, Patch):  # the base version's bytes, held exactly, become this one's
                        if target is None or name in self.quantized:
                            raise WeightError(f"tensor {name}: a patch applies only to a tensor held as published")
                        tensor.apply_to(target)
                        copied.add(target.untyped_storage().data_ptr())
                        continue
                    if target is None or target.shape != tensor.shape:
                        raise WeightError(
                            f"tensor {name}: not in the model, or shaped {tuple(tensor.shape)} "
                            f"where the model has {None if target is None else tuple(target.shape)}"
                        )
                    target.copy_(tensor)
                    copied.add(target.untyped_storage().data_ptr())
                rounded = [name for name, _ in bucket if name in self.quantized and not is_adapter]
                if rounded:
                    quantize_(self.model, rounded, self.quantization)
        except PartialVersion:
            raise
        except WeightError as exc:
            if copied:
                raise PartialVersion(str(exc)) from exc
            raise
        expected = {t.untyped_storage().data_ptr(): n for n, t in self.adapter.items()} if is_adapter else self.storages
        missing = [name for ptr, name in expected.items() if ptr not in copied]
        if missing:
            raise PartialVersion(f"version {delivery.version} left out {missing[:3]}")
        if not is_adapter:
            for name, tensor in self.adapter.items():  # a full version is the model alone
                if ".lora_B." in name:
                    tensor.zero_()

    def _adapt(self, delivery: Delivery) -> None:
        """The adapter version's base and shape against this model's; its layers put in by the first."""
        info = delivery.manifest.adapter
        version = delivery.version
        refusal = adapter_refusal(info.base_digest, info.config_json, self.model_path, self.adapter_json)
        if refusal:
            raise WeightError(f"version {version}: {refusal}")
        if not self.adapter_json:
            try:
                self.adapter = inject(self.model, info.config_json)
            except ValueError as exc:
                raise WeightError(f"version {version}: {exc}") from None
            self.adapter_json = info.config_json

    def _check(self, delivery: Delivery, targets: dict[str, torch.Tensor]) -> None:
        """What the manifest announces, against the model, before anything is copied."""
        for spec in delivery.manifest.tensors:
            target = targets.get(spec.name)
            if target is None or list(target.shape) != list(spec.shape):
                raise WeightError(
                    f"version {delivery.version}: tensor {spec.name} {list(spec.shape)} does not fit "
                    f"the model{'' if target is None else f' ({list(target.shape)})'}"
                )

    def holds_published(self, manifest) -> bool:
        """Whether every patched tensor of `manifest` is held as published (its dtype, not re-rounded,
        contiguous) on whatever device: a patch then applies to it in place."""
        for spec in manifest.tensors:
            if spec.HasField("patch"):
                target = self.targets.get(spec.name)
                if (
                    target is None
                    or spec.name in self.quantized
                    or str(target.dtype).removeprefix("torch.") != spec.dtype
                    or not target.is_contiguous()
                ):
                    return False
        return True

    def bytes_of(self, name: str, dtype: str) -> memoryview | None:
        """A tensor's bytes as published in `dtype`, when the engine holds exactly those (on the
        CPU, in that dtype, not re-rounded); else None."""
        target = self.targets.get(name, self.adapter.get(name))
        if (
            target is None
            or name in self.quantized
            or str(target.dtype).removeprefix("torch.") != dtype
            or target.device.type != "cpu"
        ):
            return None
        return tensor_to_bytes(target)
