"""Quantized weights in the layouts the GEMM kernels of ``conveyor.kernels.quant_gemm`` read, so a layer
keeps its weight quantized and multiplies through the kernel instead of holding it dequantized.
Each scheme converts its checkpoint parts to one of these (``QuantScheme.kernel_weight``); the
pieces of one fused tensor (q/k/v, gate/up) are concatenated along the output rows. Under
tensor parallelism a rank keeps its ``Shard`` of the packed weight and of its scales
(``KernelWeight.take``), refused where the split falls inside a scale block."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from conveyor.engine.distributed.sharding import Shard, merged_ranges
from conveyor.engine.quantization.packing import pack_int32


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

    @abstractmethod
    def scale_block(self) -> tuple[int, int]:
        """(rows, inputs) one scale covers: a shard must start on such a boundary."""

    @abstractmethod
    def narrow(self, dim: int, start: int, size: int) -> KernelWeight:
        """Rows (``dim`` 0) or inputs (1) ``[start, start + size)``, on scale-block boundaries."""

    def splits_exactly(self, dim: int) -> bool:
        """Whether a rank holding a part along ``dim`` computes its share of the whole layer's
        arithmetic exactly (not so where the layer's own input scale would see only the part)."""
        return True

    def is_split_by(self, shard: Shard | None) -> bool:
        """Whether ``shard`` is less than the whole weight."""
        if shard is None:
            return False
        return merged_ranges(shard.ranges) != [(0, (self.rows, self.cols)[shard.dim])]

    def take(self, shard: Shard | None) -> KernelWeight:
        """This tensor-parallel rank's ``shard`` of the weight and its scales; ``ValueError``
        where a range starts or ends inside a scale block (the block would be split)."""
        if shard is None or not self.is_split_by(shard):
            return self
        ranges = merged_ranges(shard.ranges)
        extent = (self.rows, self.cols)[shard.dim]
        block = self.scale_block()[shard.dim]
        for start, size in ranges:
            if start % block or (size % block and start + size != extent):
                what = ("output rows", "inputs")[shard.dim]
                raise ValueError(
                    f"{self.describe()} cannot be split at {what} [{start}, {start + size}): a scale block "
                    f"covers {block} {what}, and the split would cut one; use a tensor_parallel_size that "
                    "splits on whole blocks"
                )
        parts = [self.narrow(shard.dim, start, size) for start, size in ranges]
        if len(parts) == 1:
            return parts[0]
        joined = concat(parts) if shard.dim == 0 else None
        if joined is None:
            raise ValueError(f"{self.describe()}: a shard of {len(parts)} separate input ranges is not supported")
        return joined

    def describe(self) -> str:
        return f"a {type(self).__name__} [{self.rows}, {self.cols}]"


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
        from conveyor.kernels.quant_gemm import w4a16_gemm  # imports Triton: only where a kernel runs

        return w4a16_gemm(x, self.qweight, self.scales, self.zeros, self.group_size)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def to(self, device: torch.device) -> Int4Weight:
        return Int4Weight(self.qweight.to(device), self.scales.to(device), self.zeros.to(device), self.group_size)

    def scale_block(self) -> tuple[int, int]:
        return 1, self.group_size

    def narrow(self, dim: int, start: int, size: int) -> Int4Weight:
        if dim == 0:
            rows = slice(start, start + size)
            return Int4Weight(self.qweight[rows], self.scales[rows], self.zeros[rows], self.group_size)
        g = self.group_size
        return Int4Weight(
            self.qweight[:, start // 8 : (start + size) // 8].contiguous(),
            self.scales[:, start // g : (start + size) // g].contiguous(),
            self.zeros[:, start // g : (start + size) // g].contiguous(),
            g,
        )

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
        kept = cls.grid(weight, scale, block)
        return kept if kept is not None and kept.kernel_tiles else None

    @classmethod
    def grid(cls, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> Fp8Weight | None:
        """One scale a ``block`` of any width (``None`` where the scales do not tile the weight):
        for a W8A8 layer, which emulates the product where the kernel's tiles would straddle."""
        rows, cols = weight.shape
        if tuple(scale.shape) != (-(-rows // block[0]), -(-cols // block[1])):
            return None
        return cls(weight, scale.to(torch.float32).contiguous(), block)

    @property
    def kernel_tiles(self) -> bool:
        """Whether ``fp8_block_gemm``'s K tiles (16 to 64 inputs) each fall inside one block."""
        width = self.block[1]
        return not (width % 16 or (width > 64 and width % 64))

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
        from conveyor.kernels.quant_gemm import fp8_block_gemm  # imports Triton: only where a kernel runs

        return fp8_block_gemm(x, self.weight, self.scale, self.block)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale))

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.block)

    def scale_block(self) -> tuple[int, int]:
        # One scale across all the inputs (per-tensor, per-channel): any split of them keeps it.
        return self.block[0], 1 if self.scale.shape[1] == 1 else self.block[1]

    def narrow(self, dim: int, start: int, size: int) -> Fp8Weight:
        b0, b1 = self.block
        if dim == 0:
            rows = self.scale[start // b0 : -(-(start + size) // b0)]
            return Fp8Weight(self.weight[start : start + size], rows, self.block)
        weight = self.weight[:, start : start + size].contiguous()
        if self.scale.shape[1] == 1:
            return Fp8Weight(weight, self.scale, (b0, -(-size // 64) * 64))
        return Fp8Weight(weight, self.scale[:, start // b1 : -(-(start + size) // b1)].contiguous(), self.block)

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


@dataclass(frozen=True)
class Q8_0Weight(KernelWeight):
    """``q8_0_gemm``'s layout: GGUF Q8_0's bytes in two tensors, ``qs`` [rows, cols] int8 and
    ``d`` [rows, cols / 32] fp16 (``conveyor.kernels.gguf_blocks.split_q8_0``)."""

    qs: torch.Tensor
    d: torch.Tensor

    @classmethod
    def from_blocks(cls, raw: torch.Tensor) -> Q8_0Weight:
        """From the file's rows of 34-byte blocks ``[rows, cols / 32 * 34]`` uint8."""
        from conveyor.kernels.gguf_blocks import split_q8_0

        return cls(*split_q8_0(raw))

    @property
    def rows(self) -> int:  # type: ignore[override]
        return self.qs.shape[0]

    @property
    def cols(self) -> int:  # type: ignore[override]
        return self.qs.shape[1]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from conveyor.kernels.quant_gemm import q8_0_gemm  # imports Triton: only where a kernel runs

        return q8_0_gemm(x, self.qs, self.d)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d))

    def to(self, device: torch.device) -> Q8_0Weight:
        return Q8_0Weight(self.qs.to(device), self.d.to(device))

    @classmethod
    def concat(cls, pieces: Sequence[KernelWeight]) -> Q8_0Weight | None:
        q8 = [p for p in pieces if isinstance(p, Q8_0Weight)]
        if len(q8) != len(pieces) or len({p.cols for p in q8}) != 1:
            return None
        return cls(torch.cat([p.qs for p in q8]), torch.cat([p.d for p in q8]))

    def scale_block(self) -> tuple[int, int]:
        return 1, 32

    def narrow(self, dim: int, start: int, size: int) -> Q8_0Weight:
        if dim == 0:
            return Q8_0Weight(self.qs[start : start + size], self.d[start : start + size])
        return Q8_0Weight(
            self.qs[:, start : start + size].contiguous(), self.d[:, start // 32 : (start + size) // 32].contiguous()
        )


@dataclass(frozen=True)
class Q4KWeight(KernelWeight):
    """``q4_k_gemm``'s layout: GGUF Q4_K's bytes in four tensors (``conveyor.kernels.gguf_blocks.split_q4_k``):
    ``qs`` [rows, cols / 2] uint8 nibbles, ``scales`` [rows, cols / 256 * 12] uint8 (eight
    6-bit scales and mins a super-block), ``d`` and ``dmin`` [rows, cols / 256] fp16."""

    qs: torch.Tensor
    scales: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    @classmethod
    def from_blocks(cls, raw: torch.Tensor) -> Q4KWeight:
        """From the file's rows of 144-byte super-blocks ``[rows, cols / 256 * 144]`` uint8."""
        from conveyor.kernels.gguf_blocks import split_q4_k

        return cls(*split_q4_k(raw))

    @property
    def rows(self) -> int:  # type: ignore[override]
        return self.qs.shape[0]

    @property
    def cols(self) -> int:  # type: ignore[override]
        return self.qs.shape[1] * 2

    def _parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qs, self.scales, self.d, self.dmin

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from conveyor.kernels.quant_gemm import q4_k_gemm  # imports Triton: only where a kernel runs

        return q4_k_gemm(x, *self._parts())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._parts())

    def to(self, device: torch.device) -> Q4KWeight:
        return Q4KWeight(*(t.to(device) for t in self._parts()))

    @classmethod
    def concat(cls, pieces: Sequence[KernelWeight]) -> Q4KWeight | None:
        q4 = [p for p in pieces if isinstance(p, Q4KWeight)]
        if len(q4) != len(pieces) or len({p.cols for p in q4}) != 1:
            return None
        return cls(*(torch.cat(parts) for parts in zip(*(p._parts() for p in q4), strict=True)))

    def scale_block(self) -> tuple[int, int]:
        return 1, 256

    def narrow(self, dim: int, start: int, size: int) -> Q4KWeight:
        if dim == 0:
            return Q4KWeight(*(t[start : start + size] for t in self._parts()))
        first, blocks = start // 256, size // 256
        return Q4KWeight(
            self.qs[:, start // 2 : (start + size) // 2].contiguous(),
            self.scales[:, first * 12 : (first + blocks) * 12].contiguous(),
            self.d[:, first : first + blocks].contiguous(),
            self.dmin[:, first : first + blocks].contiguous(),
        )


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
