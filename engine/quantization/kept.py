"""Quantized weights kept quantized in the model, multiplied through a GEMM kernel.

Where the kernels run (CUDA, or the Triton interpreter when ``KEEP_ON_CPU`` forces it for
tests) and the model has one rank, a layer's ``quantized_linears`` (the weights its forward
only passes to ``F.linear``) whose every piece a kernel serves become a
``QuantizedLinearWeight``: a tensor of the weight's shape and dtype with no storage of its
own, whose ``F.linear`` calls the kernel. The forward passes are unchanged. Likewise a layer's
``quantized_experts`` (stacked experts' weights in transformers' ``[experts, in, out]``, which
its forward hands to the fused MoE kernel) become a ``KeptExpertsWeight`` where the format has an
experts' layout of the kernel (MXFP4). Elsewhere (the CPU, tensor parallelism, a piece no
kernel serves) the weight stays dequantized, except that a W8A8 weight (its layer quantizes its
input too) is kept on the CPU as well, where it emulates the arithmetic
(``engine.quantization.w8a8``); under tensor parallelism it is dequantized and its activations
stay in full precision.

Loading still fills the dequantized weight first (the fallback should a piece not stack), so
the peak while loading is the unquantized model's; once loaded the model holds the packed
weights and their scales only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import parallel_state
from engine.quantization.kernel_weights import KernelWeight, concat
from kernels.reference import Mxfp4Weight

# Keep weights quantized on CPU too, run in Triton's interpreter (slow: for tests).
KEEP_ON_CPU = False


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


class KeptExpertsWeight(torch.Tensor):
    """Stacked experts' weights ``[experts, in, out]`` held as the fused MoE kernel's
    ``Mxfp4Weight`` (``[experts, out, in]`` packed): only that kernel reads them (``kernel``)."""

    kernel: Mxfp4Weight

    @staticmethod
    def __new__(cls, kernel: Mxfp4Weight, dtype: torch.dtype, device: torch.device) -> KeptExpertsWeight:
        experts, rows, cols = kernel.shape
        tensor = torch.Tensor._make_wrapper_subclass(cls, (experts, cols, rows), dtype=dtype, device=device)
        tensor.kernel = kernel
        return tensor

    def __repr__(self, **_: Any) -> str:  # type: ignore[override]  # (torch passes tensor_contents)
        return f"KeptExpertsWeight(Mxfp4Weight, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError(f"experts' weights kept quantized serve the fused MoE kernel only, not {func}")


def _linear(x: torch.Tensor, weight: QuantizedLinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = weight.kernel.matmul(x.reshape(-1, x.shape[-1]))
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def keeps_quantized(device: torch.device) -> bool:
    """Whether this process keeps quantized weights quantized on ``device``."""
    if parallel_state.current().world_size > 1:
        return False  # the packed shards along K of row-parallel layers are not cut yet
    if device.type == "cuda":
        return True
    from kernels.interpreter import is_interpreting

    return KEEP_ON_CPU and device.type == "cpu" and is_interpreting()


class KeptWeights:
    """Collects the kernel pieces of each eligible weight while the loader fills it, then puts
    in a ``QuantizedLinearWeight`` for each weight whose pieces cover it and stack."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.places: dict[int, tuple[nn.Module, str]] = {}
        self.keeps_all = keeps_quantized(device)
        self.expert_places: dict[int, tuple[nn.Module, str]] = {}
        if parallel_state.current().world_size == 1:
            for module in model.modules():
                for places, attr in ((self.places, "quantized_linears"), (self.expert_places, "quantized_experts")):
                    for name in getattr(module, attr, ()):
                        param = module._parameters.get(name)
                        if param is not None:
                            places[id(param)] = (module, name)
        self.pieces: dict[int, list[tuple[int, KernelWeight | None]]] = {}
        self.experts: dict[int, Mxfp4Weight] = {}

    def offer(self, target: torch.Tensor, offset: int, read: object) -> None:
        """The loader read ``read`` into ``target`` from row ``offset``."""
        if id(target) in self.expert_places:
            if not self.keeps_all:
                return
            expert_weight = getattr(read, "expert_weight", None)
            kernel = expert_weight() if expert_weight is not None and offset == 0 else None
            if kernel is not None and kernel.shape == (target.shape[0], target.shape[2], target.shape[1]):
                self.experts[id(target)] = Mxfp4Weight(kernel.blocks.to(self.device), kernel.scales.to(self.device))
            return
        if id(target) not in self.places:
            return
        if not self.keeps_all and not getattr(read, "quantizes_activations", False):
            return
        kernel_weight = getattr(read, "kernel_weight", None)
        piece = kernel_weight() if kernel_weight is not None else None
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
        for key, experts in self.experts.items():
            module, name = self.expert_places[key]
            target = module._parameters.pop(name)
            assert target is not None
            setattr(module, name, KeptExpertsWeight(experts, target.dtype, target.device))
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
