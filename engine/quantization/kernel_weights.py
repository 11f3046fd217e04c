"""Quantized weights in the layouts the GEMM kernels of ``kernels.quant_gemm`` read, so a layer
keeps its weight quantized and multiplies through the kernel instead of holding it dequantized.
Each scheme converts its checkpoint parts to one of these (``QuantScheme.kernel_weight``); the
pieces of one fused tensor (q/k/v, gate/up) are concatenated along the output rows."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.quantization.packing import pack_int32


class KernelWeight(ABC):
    """A weight ``[rows, cols]`` (outputs, inputs) that multiplies as ``x @ W.T`` through a kernel."""

    rows: int
    cols: int

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, cols] @ W.T`` -> ``[M, rows]`` in ``x``'s dtype."""

    @abstractmethod
    def nbytes(self) -> int:
        """The device memory it holds."""

    @abstractmethod
    def to(self, device: torch.device) -> KernelWeight: ...

    @classmethod
    @abstractmethod
    def concat(cls, pieces: Sequence[KernelWeight]) -> KernelWeight | None:
        """The pieces stacked along the rows, or ``None`` when their layouts do not stack."""


@dataclass(frozen=True)
class Int4Weight(KernelWeight):
    """``w4a16_gemm``'s layout: ``qweight`` [rows, cols / 8] int32 (eight consecutive inputs a
    word, lowest bits first), ``scales`` float32 and ``zeros`` int32 [rows, cols / group_size]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @classmethod
    def from_groups(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Int4Weight | None:
        """From unsigned ``q`` [rows, cols] and per-group ``scales``/``zeros`` [rows, groups]
        (groups of consecutive inputs); ``None`` where the kernel's tiling does not fit."""
        cols, groups = q.shape[1], scales.shape[1]
        if cols % groups or cols % 8:
            return None
        group_size = cols // groups
        if group_size % 16:
            return None
        return cls(
            pack_int32(q, 4),
            scales.to(torch.float32).contiguous(),
            zeros.to(torch.int32).contiguous(),
            group_size,
        )

    @property
    def rows(self) -> int:  # type: ignore[override]
        return self.qweight.shape[0]

    @property
    def cols(self) -> int:  # type: ignore[override]
        return self.qweight.shape[1] * 8

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.quant_gemm import w4a16_gemm  # imports Triton: only where a kernel runs

        return w4a16_gemm(x, self.qweight, self.scales, self.zeros, self.group_size)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def to(self, device: torch.device) -> Int4Weight:
        return Int4Weight(self.qweight.to(device), self.scales.to(device), self.zeros.to(device), self.group_size)

    @classmethod
    def concat(cls, pieces: Sequence[KernelWeight]) -> Int4Weight | None:
        if not all(isinstance(p, Int4Weight) for p in pieces):
            return None
        int4 = [p for p in pieces if isinstance(p, Int4Weight)]
        if len({(p.group_size, p.cols) for p in int4}) != 1:
            return None
        return cls(
            torch.cat([p.qweight for p in int4]),
            torch.cat([p.scales for p in int4]),
            torch.cat([p.zeros for p in int4]),
            int4[0].group_size,
        )


@dataclass(frozen=True)
class Fp8Weight(KernelWeight):
    """``fp8_block_gemm``'s layout: e4m3 ``weight`` [rows, cols] times float32 ``scale``, one
    per ``block`` of (rows, cols). A per-tensor or per-channel scale is kept one per row
    (blocks of one row by all the inputs), so that pieces with different scales stack."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @classmethod
    def per_row(cls, weight: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
        """A per-tensor (one value) or per-channel (``[rows]`` or ``[rows, 1]``) scale."""
        rows, cols = weight.shape
        row_scale = scale.to(torch.float32).reshape(-1, 1).expand(rows, 1).contiguous()
        return cls(weight, row_scale, (1, -(-cols // 64) * 64))

    @classmethod
    def blocks(cls, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> Fp8Weight | None:
        """One scale a ``block``; ``None`` where the kernel's K tiles would straddle blocks."""
        rows, cols = weight.shape
        if block[1] % 16 or (block[1] > 64 and block[1] % 64):
            return None
        if tuple(scale.shape) != (-(-rows // block[0]), -(-cols // block[1])):
            return None
        return cls(weight, scale.to(torch.float32).contiguous(), block)

    @property
    def rows(self) -> int:  # type: ignore[override]
        return self.weight.shape[0]

    @property
    def cols(self) -> int:  # type: ignore[override]
        return self.weight.shape[1]

    def dequantized(self) -> torch.Tensor:
        """The float32 weight it stores."""
        rows, cols = self.weight.shape
        full = self.scale.repeat_interleave(self.block[0], 0)[:rows].repeat_interleave(self.block[1], 1)[:, :cols]
        return self.weight.float() * full

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.quant_gemm import fp8_block_gemm  # imports Triton: only where a kernel runs

        return fp8_block_gemm(x, self.weight, self.scale, self.block)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale))

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.block)

    @classmethod
    def concat(cls, pieces: Sequence[KernelWeight]) -> Fp8Weight | None:
        if not all(isinstance(p, Fp8Weight) for p in pieces):
            return None
        fp8 = [p for p in pieces if isinstance(p, Fp8Weight)]
        if len({(p.block, p.cols) for p in fp8}) != 1:
            return None
        # Every piece but the last must end on a block boundary, or the scale grid would shift.
        if any(p.rows % p.block[0] for p in fp8[:-1]):
            return None
        return cls(torch.cat([p.weight for p in fp8]), torch.cat([p.scale for p in fp8]), fp8[0].block)


def consecutive_groups(g_idx: torch.Tensor | None, groups: int) -> bool:
    """Whether each input's group (``g_idx``; none given: in order) is a run of consecutive
    inputs, as the kernel reads them; activation order (GPTQ's ``desc_act``) is not."""
    if g_idx is None:
        return True
    cols = g_idx.numel()
    return cols % groups == 0 and torch.equal(g_idx.long().cpu(), torch.arange(cols) // (cols // groups))


def concat(pieces: Sequence[KernelWeight]) -> KernelWeight | None:
    """The pieces of one fused tensor, in row order, as one kernel weight, or ``None``."""
    return type(pieces[0]).concat(pieces)
