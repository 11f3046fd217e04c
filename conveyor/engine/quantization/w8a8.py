"""A W8A8 FP8 weight: e4m3 weights whose layer quantizes its input to e4m3 too
(``conveyor.engine.quantization.activations``), kept so on every device, as the format's arithmetic
includes the activations' rounding.

- CPU: emulated in float32 (the input quantized and dequantized, the weight dequantized on
  the fly, one float32 matmul): exact to the reference arithmetic, and slower than the
  dequantized weight would be; the layer holds the e4m3 bytes and scales only.
- CUDA sm_89+: ``torch._scaled_mm`` on the e4m3 input and weight with per-tensor scales, or on
  sm_90 with a bfloat16 output, per-row ones (per-token input, per-channel weight).
- Elsewhere (sm_80, block-scaled weights, per-group input scales, the Triton interpreter):
  ``fp8_block_gemm`` on the quantized input (its per-tensor or per-row scale applied to the
  output; per-group ones, dequantized into the input), except for blocks whose width the
  kernel's K tiles would straddle: those are emulated as on the CPU, slower and still exact.

Pieces of a fused weight (q/k/v, gate/up) may each have their own static input scale: the
input is quantized once per run of rows sharing one (``segments``), as each layer would.

Under tensor parallelism a rank keeps its part where that part computes exactly what the
whole layer would (``splits_exactly``): any split of the output rows, and a split of the
inputs on whole input groups when the input scale is static or one a group."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from conveyor.engine.quantization.activations import ActivationQuant
from conveyor.engine.quantization.kernel_weights import Fp8Weight, KernelWeight


@dataclass(frozen=True)
class W8A8Weight(KernelWeight):
    weight: Fp8Weight
    act: ActivationQuant
    # Runs of rows and their static input scale (``None`` for computed scales), in row order.
    segments: tuple[tuple[int, float | None], ...]
    # Whether every row has the same weight scale (a per-tensor one): known at load, so that
    # choosing ``_scaled_mm``'s per-tensor form needs no device read.
    uniform: bool

    @classmethod
    def of(cls, weight: Fp8Weight | None, act: ActivationQuant, input_scale: torch.Tensor | None) -> W8A8Weight | None:
        if weight is None:
            return None
        if act.group_size and weight.cols % act.group_size:
            # The format's own arithmetic (DeepSeek's and transformers' act_quant) requires it.
            raise ValueError(
                f"input groups of {act.group_size} (weight_block_size's width) do not tile a layer of "
                f"{weight.cols} inputs: its activations cannot be quantized as the format says"
            )
        static = None
        if act.strategy == "static":
            assert input_scale is not None and input_scale.numel() == 1, "one static input scale a tensor"
            static = float(input_scale.float().reshape(()))
        return cls(weight, act, ((weight.rows, static),), weight.block[0] == 1 and _uniform(weight.scale))

    @property
    def rows(self) -> int:  # type: ignore[override]
        return self.weight.rows

    @property
    def cols(self) -> int:  # type: ignore[override]
        return self.weight.cols

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.rows))
        outs, start = [], 0
        for rows, static in self.segments:
            outs.append(self._matmul_rows(x, start, start + rows, static))
            start += rows
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _matmul_rows(self, x: torch.Tensor, start: int, end: int, static: float | None) -> torch.Tensor:
        scale = self.act.scale(x, static)
        q = self.act.quantize(x, scale)
        weight = self.weight if (start, end) == (0, self.rows) else _rows(self.weight, start, end)
        if x.device.type == "cuda" and _scaled_mm_serves(x, weight, scale, self.uniform):
            return _scaled_mm(q, weight, scale, x.dtype, self.uniform)
        if (x.device.type == "cuda" or _interpreting(x.device)) and weight.kernel_tiles:
            return _triton_matmul(self.act, q, scale, weight, x.dtype)
        return (self.act.dequantize(q, scale) @ weight.dequantized().t()).to(x.dtype)

    def nbytes(self) -> int:
        return self.weight.nbytes()

    def scale_block(self) -> tuple[int, int]:
        rows, cols = self.weight.scale_block()
        # A rank's inputs must also hold whole input groups, each of which has its own scale.
        return rows, math.lcm(cols, self.act.group_size) if self.act.group_size else cols

    def splits_exactly(self, dim: int) -> bool:
        # Output rows (column parallel): every rank quantizes the whole input, as one layer
        # would. Inputs (row parallel): a static scale or one per input group is the same on a
        # rank's share; a per-token or per-tensor dynamic one would be the share's own.
        return dim == 0 or self.act.strategy in ("static", "group")

    def narrow(self, dim: int, start: int, size: int) -> KernelWeight:
        weight = self.weight.narrow(dim, start, size)
        if dim == 1:
            return W8A8Weight(weight, self.act, self.segments, self.uniform)
        segments, at = [], 0
        for rows, static in self.segments:
            kept = min(at + rows, start + size) - max(at, start)
            if kept > 0:
                segments.append((kept, static))
            at += rows
        return W8A8Weight(weight, self.act, tuple(segments), self.uniform)

    def to(self, device: torch.device) -> W8A8Weight:
        return W8A8Weight(self.weight.to(device), self.act, self.segments, self.uniform)

    @classmethod
    def concat(cls, pieces: Sequence[KernelWeight]) -> W8A8Weight | None:
        w8a8 = [p for p in pieces if isinstance(p, W8A8Weight)]
        if len(w8a8) != len(pieces) or len({p.act for p in w8a8}) != 1:
            return None
        weight = Fp8Weight.concat([p.weight for p in w8a8])
        if weight is None:
            return None
        segments: list[tuple[int, float | None]] = []
        for rows, static in (s for p in w8a8 for s in p.segments):
            if segments and segments[-1][1] == static:
                segments[-1] = (segments[-1][0] + rows, static)
            else:
                segments.append((rows, static))
        uniform = all(p.uniform for p in w8a8) and len({float(p.weight.scale.reshape(-1)[0]) for p in w8a8}) == 1
        return cls(weight, w8a8[0].act, tuple(segments), uniform)


def _rows(weight: Fp8Weight, start: int, end: int) -> Fp8Weight:
    """Rows ``start:end`` of a per-row-scaled weight (static input scales come with per-tensor
    or per-channel weight scales only)."""
    assert weight.block[0] == 1, "a segment of a block-scaled weight"
    return Fp8Weight(weight.weight[start:end], weight.scale[start:end], weight.block)


def _interpreting(device: torch.device) -> bool:
    from conveyor.kernels.interpreter import is_interpreting

    return device.type == "cpu" and is_interpreting()


def _scaled_mm_serves(x: torch.Tensor, weight: Fp8Weight, scale: torch.Tensor, uniform: bool) -> bool:
    """Whether ``torch._scaled_mm`` takes this product: a per-row weight scale, dims it
    tiles, per-tensor scales from sm_89, per-row ones on sm_90 into bfloat16."""
    if weight.block[0] != 1 or weight.cols % 16 or weight.rows % 16 or (scale.dim() > 1 and scale.shape[-1] != 1):
        return False
    capability = torch.cuda.get_device_capability(x.device)
    if capability < (8, 9):
        return False
    if scale.dim() == 0 and uniform:
        return True
    return capability >= (9, 0) and x.dtype == torch.bfloat16


def _uniform(scale: torch.Tensor) -> bool:
    return bool((scale == scale.reshape(-1)[0]).all())


def _scaled_mm(
    q: torch.Tensor, weight: Fp8Weight, scale: torch.Tensor, dtype: torch.dtype, uniform: bool
) -> torch.Tensor:
    m, n = q.shape[0], weight.rows
    if scale.dim() == 0 and uniform:
        scale_a, scale_b = scale.reshape(()), weight.scale.reshape(-1)[0].reshape(())
    else:
        scale_a = scale.reshape(-1, 1).expand(m, 1).contiguous()
        scale_b = weight.scale.reshape(1, n).contiguous()
    # The weight [N, K] row-major is the column-major [K, N] operand _scaled_mm wants.
    return torch._scaled_mm(q, weight.weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=dtype)


def _triton_matmul(
    act: ActivationQuant, q: torch.Tensor, scale: torch.Tensor, weight: Fp8Weight, dtype: torch.dtype
) -> torch.Tensor:
    from conveyor.kernels.quant_gemm import fp8_block_gemm  # imports Triton: only where a kernel runs

    if act.strategy == "group":
        return fp8_block_gemm(act.dequantize(q, scale).to(dtype), weight.weight, weight.scale, weight.block)
    # e4m3 values are exact in any float dtype: the input scale multiplies the output instead.
    out = fp8_block_gemm(q.to(dtype), weight.weight, weight.scale, weight.block)
    return (out.float() * scale.reshape(-1, 1) if scale.dim() else out.float() * scale).to(dtype)
