"""A quantized checkpoint's tensors as the unquantized model's: each quantized tensor is
dequantized to float32 when the loader reads it, then copied into the model's weights, so the
extra memory at any moment is one tensor's float32 copy; the model itself holds the
dequantized weights (the memory of an unquantized model of its dtype). Under tensor
parallelism, each rank dequantizes a tensor and keeps its shard."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from conveyor.engine.distributed.sharding import Shard
from conveyor.engine.quantization.base import QuantScheme
from conveyor.engine.quantization.kernel_weights import KernelWeight
from conveyor.kernels.reference import Mxfp4Weight

# Reads a checkpoint tensor, or only the given ``Shard`` of it (``conveyor.engine.models.loader``).
Reader = Callable[[Shard | None], torch.Tensor]
# Dtypes that only ever hold quantized values: such a tensor left over has lost its scale.
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int32, torch.uint8, torch.int8)


def dequantized(
    scheme: QuantScheme, sources: dict[str, str], get: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, str, Reader]]:
    """``(source, name, reader)`` for each tensor of the model: the checkpoint's float tensors
    as they are, each quantized group of tensors as the one tensor it stands for.
    ``sources`` maps every checkpoint tensor name to its file, ``get`` reads one whole."""
    quantized = scheme.find(sources)
    consumed = {part for q in quantized for part in q.parts.values()}
    for q in quantized:
        first = next(iter(q.parts.values()))
        yield sources[first], q.name, QuantizedReader(scheme, q.parts, get)
    for name, source in sources.items():
        if name in consumed or name.endswith(scheme.unused_suffixes):
            continue

        def plain(shard: Shard | None, name: str = name) -> torch.Tensor:
            tensor = get(name)
            if tensor.dtype in _QUANTIZED_DTYPES:
                raise ValueError(
                    f"{name}: a {tensor.dtype} tensor that no {scheme.method!r} quantized weight accounts for "
                    "(its scales missing, or a layout this format does not have)"
                )
            return tensor if shard is None else shard.take(tensor)

        yield source, name, plain


class QuantizedReader:
    """A quantized tensor's reader: called, its dequantized tensor (or shard of it);
    ``kernel_weight(shard)``, its parts (or shard of them) in a GEMM kernel's layout, or ``None``;
    ``expert_weight()``, stacked experts' parts in the fused MoE kernel's, or ``None``."""

    def __init__(self, scheme: QuantScheme, parts: Mapping[str, str], get: Callable[[str], torch.Tensor]) -> None:
        self.scheme, self.parts, self.get = scheme, parts, get
        self.quantizes_activations = scheme.quantizes_activations

    def __call__(self, shard: Shard | None) -> torch.Tensor:
        tensor = self.scheme.dequantize(self._read())
        return tensor if shard is None else shard.take(tensor)

    def kernel_weight(self, shard: Shard | None) -> KernelWeight | None:
        weight = self.scheme.kernel_weight(self._read())
        if weight is None or (shard is not None and weight.is_split_by(shard) and not weight.splits_exactly(shard.dim)):
            return None
        return weight.take(shard)

    def expert_weight(self) -> Mxfp4Weight | None:
        return self.scheme.expert_weight(self._read())

    def _read(self) -> dict[str, torch.Tensor]:
        return {role: self.get(name) for role, name in self.parts.items()}
