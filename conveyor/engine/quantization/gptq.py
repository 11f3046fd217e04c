"""``quant_method: "gptq"`` (AutoGPTQ / GPTQModel, ``checkpoint_format`` ``gptq``, or
``gptq_v2`` whose zeros are not stored minus one): ``qweight`` [in*bits/32, out] int32 packed
along the inputs, ``qzeros`` [groups, out*bits/32] packed along the outputs, ``scales``
[groups, out], ``g_idx`` [in] the group of each input (``desc_act`` reorders it).
``W[in, out] = (q - zero[g_idx]) * scale[g_idx]``, transposed."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from conveyor.engine.quantization.base import QuantizedTensor, QuantScheme, check_options, find_by_suffix, refuse
from conveyor.engine.quantization.kernel_weights import Int4Weight, consecutive_groups
from conveyor.engine.quantization.packing import unpack_int32


class GptqScheme(QuantScheme):
    method = "gptq"

    def __init__(self, config: Mapping[str, Any]) -> None:
        check_options(
            self.method,
            config,
            (
                "bits",
                "group_size",
                "desc_act",
                "sym",
                "checkpoint_format",
                "damp_percent",
                "damp_auto_increment",
                "true_sequential",
                "static_groups",
                "model_name_or_path",
                "model_file_base_name",
                "quantizer",
                "meta",
                "pack_dtype",
                "lm_head",
                "format",
                "mse",
                "v2",
                "tokenizer",
                "dataset",
                "backend",
                "use_cuda_fp16",
                "use_exllama",
                "exllama_config",
                "max_input_length",
                "modules_in_block_to_quantize",
                "module_name_preceding_first_block",  # (calibration: the layers run before the first block)
                "model_seqlen",  # (calibration: the sequence length the quantizer ran)
                "cache_block_outputs",
                "batch_size",
                "pad_token_id",
                "block_name_to_quantize",
            ),
        )
        self.bits = config.get("bits", 4)
        if self.bits not in (4, 8):
            raise refuse(self.method, "bits", self.bits, "4 or 8")
        fmt = config.get("checkpoint_format", config.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse(self.method, "checkpoint_format", fmt, "gptq or gptq_v2")
        if config.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            raise refuse(self.method, "pack_dtype", config["pack_dtype"], "int32")
        # GPTQ v1 stores each zero point minus one.
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.group_size = int(config.get("group_size", 128))

    def find(self, names: Collection[str]) -> list[QuantizedTensor]:
        roles = {"qweight": ".qweight", "qzeros": ".qzeros", "scales": ".scales", "g_idx": ".g_idx"}
        return find_by_suffix(names, roles, "qweight", ".weight", optional=("g_idx",))

    def dequantize(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        q = unpack_int32(parts["qweight"], self.bits, dim=0)  # [in, out]
        zeros = unpack_int32(parts["qzeros"], self.bits, dim=1)[:, : q.shape[1]] + self.zero_offset
        scales = parts["scales"].float()
        g_idx = parts.get("g_idx")
        if g_idx is None:
            size = self.group_size if self.group_size > 0 else q.shape[0]
            g_idx = torch.arange(q.shape[0]) // size
        g = g_idx.long()
        return ((q - zeros[g]) * scales[g]).t().contiguous()

    def kernel_weight(self, parts: Mapping[str, torch.Tensor]) -> Int4Weight | None:
        q = unpack_int32(parts["qweight"], self.bits, dim=0)  # [in, out]
        scales = parts["scales"].float()  # [groups, out]
        # The kernel reads groups of consecutive inputs: activation order (desc_act) is dequantized.
        if self.bits != 4 or not consecutive_groups(parts.get("g_idx"), scales.shape[0]):
            return None
        zeros = unpack_int32(parts["qzeros"], 4, dim=1)[:, : q.shape[1]] + self.zero_offset
        return Int4Weight.from_groups(q.t(), scales.t(), zeros.t())
