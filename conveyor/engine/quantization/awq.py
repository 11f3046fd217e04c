"""``quant_method: "awq"``, GEMM packing (AutoAWQ's ``version: "gemm"``): ``qweight`` [in, out/8]
int32, eight output columns a word in the order 0 2 4 6 1 3 5 7; ``qzeros`` [groups, out/8]
packed alike; ``scales`` [groups, out]. ``W[in, out] = (q - zero) * scale``, transposed."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from conveyor.engine.quantization.base import QuantizedTensor, QuantScheme, check_options, find_by_suffix, refuse
from conveyor.engine.quantization.kernel_weights import Int4Weight
from conveyor.engine.quantization.packing import unpack_int32

# Where each output column of a group of eight sits among a word's nibbles, inverted.
_REVERSE_ORDER = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])


class AwqScheme(QuantScheme):
    method = "awq"

    def __init__(self, config: Mapping[str, Any]) -> None:
        check_options(
            self.method,
            config,
            (
                "bits",
                "group_size",
                "zero_point",
                "version",
                "modules_to_not_convert",
                "backend",
                "do_fuse",
                "fuse_max_seq_len",
                "modules_to_fuse",
                "exllama_config",
            ),
        )
        if config.get("bits", 4) != 4:
            raise refuse(self.method, "bits", config["bits"], "4")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse(self.method, "version", config["version"], "gemm")
        if not config.get("zero_point", True):
            raise refuse(self.method, "zero_point", False, "true")
        self.group_size = int(config.get("group_size", 128))

    def find(self, names: Collection[str]) -> list[QuantizedTensor]:
        roles = {"qweight": ".qweight", "qzeros": ".qzeros", "scales": ".scales"}
        return find_by_suffix(names, roles, "qweight", ".weight")

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        q = _unpack_awq(parts["qweight"])
        zeros = _unpack_awq(parts["qzeros"])
        scales = parts["scales"].float()
        cols = q.shape[0]  # input features
        group_size = -(-cols // scales.shape[0])
        zeros = zeros.repeat_interleave(group_size, dim=0)[:cols]
        scales = scales.repeat_interleave(group_size, dim=0)[:cols]
        return ((q - zeros) * scales).t().contiguous()

    def kernel_weight(self, parts: Mapping[str, torch.Tensor]) -> Int4Weight | None:
        q = _unpack_awq(parts["qweight"])  # [in, out]
        zeros = _unpack_awq(parts["qzeros"])[:, : q.shape[1]]  # [groups, out]
        return Int4Weight.from_groups(q.t(), parts["scales"].float().t(), zeros.t())


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    values = unpack_int32(packed, 4, dim=1)
    order = (torch.arange(values.shape[1]) // 8) * 8 + _REVERSE_ORDER.repeat(values.shape[1] // 8)
    return values[:, order]
