"""Quantized weights kept quantized in the model, multiplied through a GEMM kernel.

Where the kernels run (CUDA, or the Triton interpreter when ``KEEP_ON_CPU`` forces it for
tests), a layer's ``quantized_linears`` (the weights its forward
only passes to ``F.linear``) whose every piece a kernel serves become a
``QuantizedLinearWeight``: a tensor of the weight's shape and dtype with no storage of its
own, whose ``F.linear`` calls the kernel. The forward passes are unchanged. Under tensor
parallelism each rank keeps its shard of the packed weight and its scales (a split inside a
scale block is refused). Elsewhere (the CPU, a piece no kernel serves) the weight stays
dequantized.

Loading still fills the dequantized weight first (the fallback should a piece not stack), so
the peak while loading is the unquantized model's; once loaded the model holds the packed
weights and their scales only."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.sharding import Shard
from engine.quantization.kernel_weights import KernelWeight, concat

# Keep weights quantized on CPU too, run in Triton's interpreter (slow: for tests); the
# variable carries it to a tensor-parallel test's other ranks.
KEEP_ON_CPU = False
KEEP_ON_CPU_ENV = "CONVEYOR_TEST_KEEP_QUANTIZED"


class QuantizedLinearWeight(torch.Tensor):
    """A ``[rows, cols]`` weight held as a ``KernelWeight``: only ``F.linear`` reads it."""

    kernel: KernelWeight

    @staticmethod
    def __new__(cls, kernel: KernelWeight, dtype: torch.dtype, device: torch.device) -> QuantizedLinearWeight:
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, (kernel.rows, kernel.cols), dtype=dtype, device=device, requires_grad=False
        )
        tensor.kernel = kernel
        return tensor

    def __repr__(self, **_: Any) -> str:  # type: ignore[override]  # (torch passes tensor_contents)
        return f"QuantizedLinearWeight({type(self.kernel).__name__}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.linear:
            return _linear(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        # Reached by any operation but ``F.linear`` that needs the values: there are none to read.
        raise RuntimeError(f"a weight kept quantized for its kernel serves F.linear only, not {func}")


def _linear(x: torch.Tensor, weight: QuantizedLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = weight.kernel.matmul(x.reshape(-1, x.shape[-1]))
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def keeps_quantized(device: torch.device) -> bool:
    """Whether this process keeps quantized weights quantized on ``device``."""
    if device.type == "cuda":
        return True
    from kernels.interpreter import is_interpreting

    forced = KEEP_ON_CPU or os.environ.get(KEEP_ON_CPU_ENV) == "1"
    return forced and device.type == "cpu" and is_interpreting()


class KeptWeights:
    """Collects the kernel pieces of each eligible weight while the loader fills it, then puts
    in a ``QuantizedLinearWeight`` for each weight whose pieces cover it and stack."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.places: dict[int, tuple[nn.Module, str]] = {}
        if keeps_quantized(device):
            for module in model.modules():
                for name in getattr(module, "quantized_linears", ()):
                    param = module._parameters.get(name)
                    if param is not None:
                        self.places[id(param)] = (module, name)
        self.pieces: dict[int, list[tuple[int, KernelWeight | None]]] = {}

    def offer(self, target: torch.Tensor, offset: int, read: object, shard: Shard | None = None) -> None:
        """The loader read ``read`` (this rank's ``shard`` of it) into ``target`` from row ``offset``."""
        if id(target) not in self.places:
            return
        kernel_weight = getattr(read, "kernel_weight", None)
        piece = kernel_weight(shard) if kernel_weight is not None else None
        self.pieces.setdefault(id(target), []).append((offset, piece.to(self.device) if piece else None))

    def install(self) -> int:
        """Swap in the kept weights; the number of weights kept."""
        kept = 0
        for key, pieces in self.pieces.items():
            module, name = self.places[key]
            target = module._parameters[name]
            assert target is not None
            kernel = _covering(sorted(pieces, key=lambda p: p[0]), target.shape[0])
            if kernel is None or kernel.cols != target.shape[1]:
                continue
            del module._parameters[name]
            setattr(module, name, QuantizedLinearWeight(kernel, target.dtype, target.device))
            kept += 1
        return kept


def _covering(pieces: list[tuple[int, KernelWeight | None]], rows: int) -> KernelWeight | None:
    """The pieces as one kernel weight when they tile ``rows`` rows in order, else ``None``."""
    at, parts = 0, []
    for offset, piece in pieces:
        if piece is None or offset != at:
            return None
        parts.append(piece)
        at += piece.rows
    return concat(parts) if at == rows else None
