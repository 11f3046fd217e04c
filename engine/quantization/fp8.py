"""``quant_method: "fp8"`` (transformers' FineGrainedFP8, Qwen's and DeepSeek's ``-FP8``
releases): e4m3 weights times a scale, one per ``weight_block_size`` block (``weight_scale_inv``,
blocks at the edges cut short) or one per tensor (``weight_scale_inv`` or ``weight_scale``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from engine.quantization.base import QuantizedTensor, QuantScheme, check_options, find_by_suffix, refuse
from engine.quantization.kernel_weights import Fp8Weight


class Fp8Scheme(QuantScheme):
    method = "fp8"
    # Static activation scales: the dequantizing path computes activations in full precision.
    unused_suffixes = (".input_scale", ".activation_scale")

    def __init__(self, config: Mapping[str, Any]) -> None:
        check_options(
            self.method,
            config,
            ("activation_scheme", "weight_block_size", "fmt", "modules_to_not_convert", "ignored_layers", "dequantize"),
        )
        if config.get("fmt", "e4m3") != "e4m3":
            raise refuse(self.method, "fmt", config["fmt"], "e4m3")
        if config.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise refuse(self.method, "activation_scheme", config["activation_scheme"], "dynamic or static")
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise refuse(self.method, "weight_block_size", block, "two positive integers")
        self.block: tuple[int, int] | None = (block[0], block[1]) if block is not None else None

    def find(self, names: Collection[str]) -> list[QuantizedTensor]:
        found = find_by_suffix(names, {"weight": ".weight", "scale": ".weight_scale_inv"}, "scale", ".weight")
        found += find_by_suffix(names, {"weight": ".weight", "scale": ".weight_scale"}, "scale", ".weight")
        return found

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        weight, scale = parts["weight"], parts["scale"].float()
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8 weight has dtype {weight.dtype}, expected float8_e4m3fn")
        if scale.numel() == 1:
            return weight.float() * scale.reshape(())
        if self.block is None:
            raise ValueError(f"fp8 scale of shape {tuple(scale.shape)} without weight_block_size in the config")
        return dequantize_blocks(weight.float(), scale, self.block)

    def kernel_weight(self, parts: Mapping[str, torch.Tensor]) -> Fp8Weight | None:
        return fp8_kernel_weight(parts["weight"], parts["scale"], self.block)


def fp8_kernel_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> Fp8Weight | None:
    """An e4m3 weight with one scale, one per row, or one per ``block``, for ``fp8_block_gemm``."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        return None
    rows = weight.shape[0]
    if scale.numel() == 1 or tuple(scale.shape) in ((rows,), (rows, 1)):
        return Fp8Weight.per_row(weight, scale)
    return Fp8Weight.blocks(weight, scale, block) if block is not None else None


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` [rows, cols] times one scale per ``block`` (the last block of each dim may be short)."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    if scale.shape != (-(-rows // block_rows), -(-cols // block_cols)):
        raise ValueError(
            f"scale grid {tuple(scale.shape)} does not tile a weight of shape {tuple(weight.shape)} in {block} blocks"
        )
    full = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return weight * full
