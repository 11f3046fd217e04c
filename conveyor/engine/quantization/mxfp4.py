"""``quant_method: "mxfp4"`` (gpt-oss): OCP microscaling FP4. ``<name>_blocks`` uint8 [..., rows,
groups, 16] holds two e2m1 values a byte (low nibble first), 32 values a group; ``<name>_scales``
uint8 [..., rows, groups] one power-of-two exponent a group (biased by 127). gpt-oss stores its
experts' ``gate_up_proj``/``down_proj`` this way with rows the outputs; dequantized, a 3-D
tensor takes transformers' unquantized expert layout [experts, in, out], under ``<name>``."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from conveyor.engine.quantization.base import QuantizedTensor, QuantScheme, check_options, find_by_suffix
from conveyor.kernels.reference import Mxfp4Weight

# e2m1: sign, two exponent bits, one mantissa bit.
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


class Mxfp4Scheme(QuantScheme):
    method = "mxfp4"

    def __init__(self, config: Mapping[str, Any]) -> None:
        check_options(self.method, config, ("modules_to_not_convert", "dequantize"))

    def find(self, names: Collection[str]) -> list[QuantizedTensor]:
        return find_by_suffix(names, {"blocks": "_blocks", "scales": "_scales"}, "blocks", "")

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_mxfp4(parts["blocks"], parts["scales"])

    def expert_weight(self, parts: Mapping[str, torch.Tensor]) -> Mxfp4Weight | None:
        """Experts' ``[experts, rows, groups, 16]`` blocks as the fused MoE kernel reads them
        (``[experts, rows, in / 2]`` bytes, the scales as they are): no bytes change."""
        blocks, scales = parts["blocks"], parts["scales"]
        if (
            blocks.dim() != 4
            or blocks.shape[-1] != 16
            or blocks.dtype != torch.uint8
            or blocks.shape[:-1] != scales.shape
        ):
            return None
        return Mxfp4Weight(blocks.flatten(-2).contiguous(), scales.contiguous())


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype} "
            "do not match (uint8 [..., groups, 16] and [..., groups])"
        )
    values = torch.stack((FP4_VALUES[(blocks & 0xF).long()], FP4_VALUES[(blocks >> 4).long()]), dim=-1)
    values = values.reshape(*blocks.shape[:-1], 32) * torch.exp2(scales.float() - 127).unsqueeze(-1)
    weight = values.reshape(*blocks.shape[:-2], -1)  # [..., rows, in]
    return weight.transpose(-2, -1).contiguous() if weight.dim() >= 3 else weight
