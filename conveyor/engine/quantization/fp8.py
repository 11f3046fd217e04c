"""``quant_method: "fp8"`` (transformers' FineGrainedFP8, Qwen's and DeepSeek's ``-FP8``
releases): e4m3 weights times a scale, one per ``weight_block_size`` block (``weight_scale_inv``,
blocks at the edges cut short) or one per tensor (``weight_scale_inv`` or ``weight_scale``).

Activations are quantized to e4m3 too (W8A8), as ``activation_scheme`` says: ``static``, by the
checkpoint's per-tensor ``input_scale``; ``dynamic``, by a scale computed per group of
``weight_block_size[1]`` inputs of each token for block-scaled weights (DeepSeek's and vLLM's
arithmetic), else one per tensor (vLLM's)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from conveyor.engine.quantization.activations import ActivationQuant
from conveyor.engine.quantization.base import QuantizedTensor, QuantScheme, check_options, find_by_suffix, refuse
from conveyor.engine.quantization.kernel_weights import Fp8Weight
from conveyor.engine.quantization.w8a8 import W8A8Weight


class Fp8Scheme(QuantScheme):
    method = "fp8"
    # Activation scales of a dynamic checkpoint, where it ships them: unused.
    unused_suffixes = (".input_scale", ".activation_scale")
    quantizes_activations = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        check_options(
            self.method,
            config,
            ("activation_scheme", "weight_block_size", "fmt", "modules_to_not_convert", "ignored_layers", "dequantize"),
        )
        if config.get("fmt", "e4m3") != "e4m3":
            raise refuse(self.method, "fmt", config["fmt"], "e4m3")
        activation_scheme = config.get("activation_scheme", "dynamic")
        if activation_scheme not in ("dynamic", "static"):
            raise refuse(self.method, "activation_scheme", activation_scheme, "dynamic or static")
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise refuse(self.method, "weight_block_size", block, "two positive integers")
        self.block: tuple[int, int] | None = (block[0], block[1]) if block is not None else None
        if activation_scheme == "static" and block is not None:
            raise refuse(self.method, "activation_scheme", "static", "dynamic with weight_block_size")
        if activation_scheme == "static":
            self.act = ActivationQuant("static")
        elif self.block is not None:
            self.act = ActivationQuant("group", self.block[1])
        else:
            self.act = ActivationQuant("tensor")

    def find(self, names: Collection[str]) -> list[QuantizedTensor]:
        found = []
        for scale in (".weight_scale_inv", ".weight_scale"):
            roles = {"weight": ".weight", "scale": scale}
            if self.act.strategy == "static":
                roles["input_scale"] = ".input_scale"
            found += find_by_suffix(names, roles, "scale", ".weight")
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

    def kernel_weight(self, parts: Mapping[str, torch.Tensor]) -> W8A8Weight | None:
        weight = fp8_kernel_weight(parts["weight"], parts["scale"], self.block, w8a8=True)
        return W8A8Weight.of(weight, self.act, parts.get("input_scale"))


def fp8_kernel_weight(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, w8a8: bool = False
) -> Fp8Weight | None:
    """An e4m3 weight with one scale, one per row, or one per ``block``, for ``fp8_block_gemm``;
    for a ``w8a8`` layer, blocks of any width (``W8A8Weight`` emulates what the kernel cannot
    tile: dequantized, the weight alone would drop the activations' rounding)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        return None
    rows = weight.shape[0]
    if scale.numel() == 1 or tuple(scale.shape) in ((rows,), (rows, 1)):
        return Fp8Weight.per_row(weight, scale)
    if block is None:
        return None
    return Fp8Weight.grid(weight, scale, block) if w8a8 else Fp8Weight.blocks(weight, scale, block)


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
