"""``quant_method: "compressed-tensors"`` (llm-compressor's checkpoints) in two formats:

- ``float-quantized``: e4m3 ``weight`` times ``weight_scale`` per tensor, per output channel or
  per block; with ``input_activations`` (W8A8 FP8) each layer's input quantized to e4m3 too, by
  the checkpoint's static per-tensor ``input_scale`` or a dynamic scale per tensor, token or
  group (``conveyor.engine.quantization.activations``);
- ``pack-quantized``: int4 or int8 ``weight_packed`` (int32 words, lowest bits first, stored
  offset by ``2**(bits-1)``), times ``weight_scale`` per group of inputs or per channel, minus
  ``weight_zero_point`` (packed along the output dim) when asymmetric; ``weight_g_idx`` maps
  each input column to its group when the checkpoint was quantized with activation order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from conveyor.engine.quantization.activations import ActivationQuant
from conveyor.engine.quantization.base import QuantizedTensor, QuantScheme, check_options, find_by_suffix, refuse
from conveyor.engine.quantization.fp8 import dequantize_blocks, fp8_kernel_weight
from conveyor.engine.quantization.kernel_weights import Int4Weight, KernelWeight, consecutive_groups
from conveyor.engine.quantization.kv_cache_scheme import check_kv_cache_scheme
from conveyor.engine.quantization.packing import unpack_int32
from conveyor.engine.quantization.w8a8 import W8A8Weight

_PACKED = "pack-quantized"
_FLOAT = "float-quantized"
_KNOWN = (
    "config_groups",
    "format",
    "ignore",
    "quantization_status",
    "kv_cache_scheme",
    "sparsity_config",
    "transform_config",
    "global_compression_ratio",
    "version",
    "provider",
    "moe_sparsity_config",  # (pruned or collapsed experts: refused when set)
)
_WEIGHT_OPTIONS = (
    "num_bits",
    "type",
    "strategy",
    "group_size",
    "symmetric",
    "dynamic",
    "actorder",
    "block_structure",
    "observer",
    "observer_kwargs",
    "scale_dtype",
    "zp_dtype",
)


class CompressedTensorsScheme(QuantScheme):
    method = "compressed-tensors"
    unused_suffixes = (".input_scale", ".input_zero_point")

    def __init__(self, config: Mapping[str, Any]) -> None:
        check_options(self.method, config, _KNOWN)
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise refuse(self.method, "quantization_status", status, "compressed")
        for option in ("sparsity_config", "transform_config", "moe_sparsity_config"):
            if config.get(option):
                raise refuse(self.method, option, config[option], "none")
        kv_cache_scheme = config.get("kv_cache_scheme")
        if kv_cache_scheme:  # the scales' tensors are the loader's (``conveyor.engine.models.kv_scales``)
            check_kv_cache_scheme(self.method, kv_cache_scheme)
        groups = config.get("config_groups") or {}
        if not groups and not kv_cache_scheme:
            raise ValueError(f"quantization {self.method!r}: no config_groups")
        self.formats: set[str] = set()
        self.packed_bits: int | None = None
        self.block: tuple[int, int] | None = None
        self.acts: set[ActivationQuant | None] = set()
        for name, group in groups.items():
            self._read_group(name, group, group.get("format") or config.get("format"))
        if len(self.acts) > 1:
            raise ValueError(f"quantization {self.method!r}: config_groups quantize their activations differently")
        self.act = next(iter(self.acts), None)
        self.quantizes_activations = self.act is not None

    def _read_group(self, name: str, group: Mapping[str, Any], fmt: str | None) -> None:
        weights = group.get("weights")
        if not weights:
            raise refuse(self.method, f"config_groups.{name}.weights", weights, "weight quantization")
        check_options(f"{self.method} config_groups.{name}.weights", weights, _WEIGHT_OPTIONS)
        if group.get("output_activations"):
            raise refuse(self.method, f"config_groups.{name}.output_activations", "set", "none")
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        if weights.get("dynamic"):
            raise refuse(self.method, f"config_groups.{name}.weights.dynamic", True, "static weight scales")
        if fmt == _PACKED and kind == "int" and bits in (4, 8) and strategy in ("group", "channel"):
            if self.packed_bits not in (None, bits):
                raise ValueError(f"quantization {self.method!r}: packed groups of {self.packed_bits} and {bits} bits")
            self.packed_bits = bits
        elif fmt == _FLOAT and kind == "float" and bits == 8 and strategy in ("tensor", "channel", "block"):
            if not weights.get("symmetric", True):
                raise refuse(self.method, f"config_groups.{name}.weights.symmetric", False, "symmetric FP8")
            if strategy == "block":
                rows, cols = weights["block_structure"]
                self.block = (int(rows), int(cols))
            self.acts.add(self._activations(name, group.get("input_activations")))
        else:
            raise ValueError(
                f"quantization {self.method!r}: config_groups.{name} ({fmt}, {kind}{bits} {strategy}) is not "
                f"supported: {_PACKED} int4/int8 by group or channel, {_FLOAT} fp8 by tensor, channel or block"
            )
        if fmt == _PACKED and group.get("input_activations"):
            raise refuse(self.method, f"config_groups.{name}.input_activations", "set", f"none with {_PACKED}")
        self.formats.add(fmt)

    def _activations(self, name: str, args: Mapping[str, Any] | None) -> ActivationQuant | None:
        """How a float-quantized group quantizes its inputs (``None``: it does not)."""
        if not args:
            return None
        where = f"config_groups.{name}.input_activations"
        check_options(f"{self.method} {where}", args, _WEIGHT_OPTIONS)
        kind, bits = args.get("type"), args.get("num_bits")
        strategy, dynamic, group_size = args.get("strategy"), args.get("dynamic"), args.get("group_size")
        if kind != "float" or bits != 8:
            raise refuse(self.method, where, f"{kind}{bits}", "float8")
        if not args.get("symmetric", True):
            raise refuse(self.method, f"{where}.symmetric", False, "symmetric FP8")
        if strategy == "tensor" and dynamic is False:
            return ActivationQuant("static")
        if strategy in ("tensor", "token") and dynamic is True:
            return ActivationQuant(strategy)
        if strategy == "group" and dynamic is True and isinstance(group_size, int) and group_size > 0:
            return ActivationQuant("group", group_size)
        raise refuse(
            self.method,
            where,
            f"{strategy} dynamic={dynamic}",
            "static per tensor, or dynamic per tensor, token or group",
        )

    def find(self, names: Collection[str]) -> list[QuantizedTensor]:
        found: list[QuantizedTensor] = []
        if _PACKED in self.formats:
            roles = {
                "packed": ".weight_packed",
                "scale": ".weight_scale",
                "shape": ".weight_shape",
                "zero_point": ".weight_zero_point",
                "g_idx": ".weight_g_idx",
            }
            found += find_by_suffix(names, roles, "packed", ".weight", optional=("zero_point", "g_idx"))
        if _FLOAT in self.formats:
            packed = {q.name for q in found}
            roles = {"weight": ".weight", "scale": ".weight_scale"}
            if self.act is not None and self.act.strategy == "static":
                roles["input_scale"] = ".input_scale"
            floats = find_by_suffix(names, roles, "scale", ".weight")
            found += [q for q in floats if q.name not in packed]
        return found

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        scale = parts["scale"].float()
        if "packed" not in parts:
            weight = parts["weight"]
            if weight.dtype != torch.float8_e4m3fn:
                raise ValueError(f"float-quantized weight has dtype {weight.dtype}, expected float8_e4m3fn")
            if self.block is not None and scale.dim() == 2 and scale.shape[1] > 1:
                return dequantize_blocks(weight.float(), scale, self.block)
            return weight.float() * (scale.reshape(()) if scale.numel() == 1 else scale)
        assert self.packed_bits is not None
        bits, offset = self.packed_bits, 1 << (self.packed_bits - 1)
        rows, cols = (int(n) for n in parts["shape"].tolist())
        q = unpack_int32(parts["packed"], bits, dim=1)[:, :cols] - offset
        zero = torch.zeros((), dtype=torch.int64)
        if "zero_point" in parts:
            zero = unpack_int32(parts["zero_point"], bits, dim=0)[:rows] - offset
        return (q - _per_column(zero, cols, parts.get("g_idx"))) * _per_column(scale, cols, parts.get("g_idx"))

    def kernel_weight(self, parts: Mapping[str, torch.Tensor]) -> KernelWeight | None:
        if "packed" not in parts:
            weight = fp8_kernel_weight(parts["weight"], parts["scale"], self.block, w8a8=self.act is not None)
            return weight if self.act is None else W8A8Weight.of(weight, self.act, parts.get("input_scale"))
        if self.packed_bits != 4 or not consecutive_groups(parts.get("g_idx"), parts["scale"].shape[-1]):
            return None
        rows, cols = (int(n) for n in parts["shape"].tolist())
        # The stored integers are offset by 8: unsigned already, as the kernel reads them.
        q = unpack_int32(parts["packed"], 4, dim=1)[:, :cols]
        scale = parts["scale"].float().reshape(rows, -1)
        zero = torch.full(scale.shape, 8, dtype=torch.int64)
        if "zero_point" in parts:
            zero = unpack_int32(parts["zero_point"], 4, dim=0)[:rows].reshape(rows, -1)
        return Int4Weight.from_groups(q, scale, zero)


def _per_column(value: torch.Tensor, cols: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """A per-group ``[rows, groups]`` value for each of ``cols`` input columns (groups of
    ``cols / groups`` in order, or as ``g_idx`` maps them); a per-channel ``[rows, 1]`` one as is."""
    if value.dim() == 0 or value.shape[-1] == 1:
        return value
    if g_idx is not None:
        return value[:, g_idx.long()]
    group_size = -(-cols // value.shape[1])
    return value.repeat_interleave(group_size, dim=1)[:, :cols]
