"""What every quantization format shares: a scheme read from ``config.json``'s
``quantization_config``, which finds its quantized tensors among a checkpoint's names and
dequantizes each one to the float tensor transformers' unquantized model would hold."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from conveyor.engine.quantization.kernel_weights import KernelWeight
from conveyor.kernels.reference import Mxfp4Weight


@dataclass(frozen=True)
class QuantizedTensor:
    # The unquantized tensor it stands for, under transformers' name ("...q_proj.weight").
    name: str
    # Each part the format stores it in (role -> checkpoint tensor name).
    parts: Mapping[str, str]


class QuantScheme(ABC):
    # ``quantization_config["quant_method"]`` of the format.
    method: ClassVar[str]
    # Checkpoint tensors the dequantizing path does not use (activation scales): skipped.
    unused_suffixes: ClassVar[tuple[str, ...]] = ()
    # Whether its layers quantize their inputs too (W8A8): their weights are then kept
    # quantized on every device, since the activations' rounding is part of the arithmetic.
    quantizes_activations: bool = False

    @abstractmethod
    def __init__(self, config: Mapping[str, Any]) -> None:
        """The scheme ``config`` (the ``quantization_config``) describes; ``ValueError`` naming
        an option or value it does not support."""

    @abstractmethod
    def find(self, names: Collection[str]) -> list[QuantizedTensor]:
        """The quantized tensors among a checkpoint's tensor names."""

    @abstractmethod
    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The float32 tensor the parts (by role) store."""

    def kernel_weight(self, parts: Mapping[str, torch.Tensor]) -> KernelWeight | None:
        """The parts in a GEMM kernel's layout, kept quantized, or ``None`` where no kernel
        serves them (the weight is then dequantized)."""
        return None

    def expert_weight(self, parts: Mapping[str, torch.Tensor]) -> Mxfp4Weight | None:
        """Stacked experts' parts in the fused MoE kernel's layout, kept quantized, or ``None``."""
        return None


def find_by_suffix(
    names: Collection[str],
    roles: Mapping[str, str],
    anchor: str,
    target_suffix: str,
    optional: Collection[str] = (),
) -> list[QuantizedTensor]:
    """Group tensors sharing a stem: each name ending with ``roles[anchor]`` starts one, whose
    other roles are the stem plus their suffix; a required one missing is an error."""
    found = []
    anchor_suffix = roles[anchor]
    present = set(names)
    for name in sorted(present):
        if not name.endswith(anchor_suffix):
            continue
        stem = name[: -len(anchor_suffix)]
        parts = {role: stem + suffix for role, suffix in roles.items() if stem + suffix in present}
        missing = [stem + roles[r] for r in roles if r not in parts and r not in optional]
        if missing:
            raise ValueError(f"quantized tensor {name!r} lacks {', '.join(missing)}")
        found.append(QuantizedTensor(stem + target_suffix, parts))
    return found


def check_options(method: str, config: Mapping[str, Any], known: Collection[str]) -> None:
    """Refuse a ``quantization_config`` key the scheme does not know: it could change the
    arithmetic, and ignoring it would dequantize wrong."""
    unknown = sorted(set(config) - set(known) - {"quant_method"})
    if unknown:
        raise ValueError(f"quantization {method!r}: unsupported option(s) {', '.join(unknown)}")


def refuse(method: str, option: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"quantization {method!r}: {option}={value!r} is not supported ({supported})")
