"""Quantized weights kept quantized in the model, multiplied through a GEMM kernel.

Where the kernels run (CUDA, or the Triton interpreter when ``KEEP_ON_CPU`` forces it for
tests), a layer's ``quantized_linears`` (the weights its forward
only passes to ``F.linear``) whose every piece a kernel serves become a
``QuantizedLinearWeight``: a tensor of the weight's shape and dtype with no storage of its
own, whose ``F.linear`` calls the kernel. The forward passes are unchanged. Under tensor
parallelism each rank keeps its shard of the packed weight and its scales (a split inside a
scale block is refused). Likewise a layer's ``quantized_experts`` (stacked experts' weights in
transformers' ``[experts, in, out]``, which its forward hands to the fused MoE kernel) become a
``KeptExpertsWeight`` at one rank where the format has an experts' layout of the kernel
(MXFP4). Elsewhere (the CPU, a piece no kernel serves) the weight stays dequantized, except that
a W8A8 weight (its layer quantizes its input too) is kept on the CPU as well, where it emulates
the arithmetic (``conveyor.engine.quantization.w8a8``); under tensor parallelism a W8A8 weight is
kept too, except a row-parallel one with per-token or per-tensor dynamic input scales (a rank's
share of the inputs would set a different scale): that one is dequantized and its activations
stay in full precision.

Loading a quantized checkpoint builds those weights on the meta device (``deferred_linears``)
and reads each quantized tensor's packed parts only, so the peak while loading is the packed
model plus one tensor; a weight that stays dequantized gets its memory then, and is read as
floats. Once loaded the model holds the packed weights and their scales only."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.sharding import Shard
from conveyor.engine.quantization.kernel_weights import KernelWeight, concat
from conveyor.kernels.reference import Mxfp4Weight

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
    if device.type == "cuda":
        return True
    from conveyor.kernels.interpreter import is_interpreting

    forced = KEEP_ON_CPU or os.environ.get(KEEP_ON_CPU_ENV) == "1"
    return forced and device.type == "cpu" and is_interpreting()


@dataclass(frozen=True)
class _Piece:
    offset: int
    kernel: KernelWeight
    read: Callable[[Shard | None], torch.Tensor]
    shard: Shard | None


class KeptWeights:
    """Takes the kernel pieces of each eligible weight as the loader reads them, and puts in a
    ``QuantizedLinearWeight`` as soon as a weight's pieces cover it and stack. A weight built
    on the meta device (``deferred_linears``) gets memory only should it stay dequantized (a
    piece no kernel serves, pieces that do not stack): it is then allocated and every piece
    read again as floats."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.places: dict[int, tuple[nn.Module, str]] = {}
        self.keeps_all = keeps_quantized(device)
        self.one_rank = parallel_state.current().world_size == 1
        self.expert_places: dict[int, tuple[nn.Module, str]] = {}
        self.experts_kept = self.keeps_all and self.one_rank
        for module in model.modules():
            for name in getattr(module, "quantized_linears", ()):
                param = module._parameters.get(name)
                if param is not None:
                    self.places[id(param)] = (module, name)
            for name in getattr(module, "quantized_experts", ()):
                param = module._parameters.get(name)
                if param is not None:
                    self.expert_places[id(param)] = (module, name)
        self.pieces: dict[int, list[_Piece]] = {}
        self.experts: dict[int, Mxfp4Weight] = {}
        # Meta weights given memory, by the id of the meta tensor the loader's slots hold.
        self.allocated: dict[int, torch.Tensor] = {}
        self.kept = 0

    def take(
        self, target: torch.Tensor, offset: int, rows: int, read: object, shard: Shard | None
    ) -> torch.Tensor | None:
        """``None`` when the kept weight took the loader's piece ``read`` (this rank's
        ``shard``, rows ``offset`` onwards of ``target``): it reads no float copy. Otherwise the
        tensor the loader fills with the floats (``target``, or the memory given a meta one)."""
        key = id(target)
        if key in self.allocated:
            return self.allocated[key]
        if key in self.expert_places:
            if self.experts_kept and self._took_experts(key, target, offset, read):
                return None
            return self._given_memory(key, *self.expert_places[key])
        if key not in self.places:
            return target
        w8a8 = getattr(read, "quantizes_activations", False)
        if not self.keeps_all and not w8a8:
            return self._dequantized(key)
        kernel_weight = getattr(read, "kernel_weight", None)
        piece = kernel_weight(shard) if kernel_weight is not None else None
        if piece is None or piece.rows != rows or piece.cols != target.shape[1]:
            return self._dequantized(key)
        pieces = self.pieces.setdefault(key, [])
        pieces.append(_Piece(offset, piece.to(self.device), read, shard))  # type: ignore[arg-type]  # (a reader)
        if sum(p.kernel.rows for p in pieces) == target.shape[0]:
            self._install(key)
        return None

    def install(self) -> int:
        """What is left (weights whose pieces never covered them) dequantized, the experts kept
        put in; the number of weights kept."""
        for key in list(self.pieces):
            self._dequantized(key)
        for key, experts in self.experts.items():
            module, name = self.expert_places[key]
            target = module._parameters.pop(name)
            assert target is not None
            setattr(module, name, KeptExpertsWeight(experts, target.dtype, self.device))
            self.kept += 1
        return self.kept

    def _took_experts(self, key: int, target: torch.Tensor, offset: int, read: object) -> bool:
        expert_weight = getattr(read, "expert_weight", None)
        kernel = expert_weight() if expert_weight is not None and offset == 0 else None
        if kernel is None or kernel.shape != (target.shape[0], target.shape[2], target.shape[1]):
            return False
        self.experts[key] = Mxfp4Weight(kernel.blocks.to(self.device), kernel.scales.to(self.device))
        return True

    def _install(self, key: int) -> None:
        module, name = self.places[key]
        target = module._parameters[name]
        assert target is not None
        kernel = _covering(sorted(self.pieces[key], key=lambda p: p.offset), target.shape[0])
        if kernel is None:
            self._dequantized(key)
            return
        del self.places[key], self.pieces[key]
        del module._parameters[name]
        setattr(module, name, QuantizedLinearWeight(kernel, target.dtype, self.device))
        self.kept += 1

    def _dequantized(self, key: int) -> torch.Tensor:
        """The weight stays dequantized: given memory if it was built on the meta device, and
        the pieces taken so far read as floats into it."""
        weight = self._given_memory(key, *self.places.pop(key))
        for p in self.pieces.pop(key, []):
            weight.data[p.offset : p.offset + p.kernel.rows].copy_(p.read(p.shard).to(weight.dtype))
        return weight

    def _given_memory(self, key: int, module: nn.Module, name: str) -> torch.Tensor:
        """The parameter, with memory on this device if it was built on the meta device (then
        the loader's later pieces of it go there too)."""
        weight = module._parameters[name]
        assert weight is not None
        if weight.is_meta:
            weight = nn.Parameter(
                torch.empty(weight.shape, dtype=weight.dtype, device=self.device), requires_grad=False
            )
            module._parameters[name] = weight
            self.allocated[key] = weight
        return weight


def deferred_linears(active: bool) -> contextlib.AbstractContextManager[None]:
    """While a model is built: its ``quantized_linears`` (and the fused kernel's
    ``quantized_experts``) made on the meta device (``linear_device``) when ``active``, so that
    loading a quantized checkpoint never holds them dequantized whole."""
    return _deferring(active)


@contextlib.contextmanager
def _deferring(active: bool) -> Iterator[None]:
    global _DEFER
    before, _DEFER = _DEFER, active
    try:
        yield
    finally:
        _DEFER = before


_DEFER = False


def linear_device(device: torch.device) -> torch.device:
    """Where a layer makes a weight of its ``quantized_linears``: ``device``, or the meta device
    while ``deferred_linears`` is on."""
    return torch.device("meta") if _DEFER else device


def _covering(pieces: list[_Piece], rows: int) -> KernelWeight | None:
    """The pieces as one kernel weight when they tile ``rows`` rows in order, else ``None``."""
    at, parts = 0, []
    for piece in pieces:
        if piece.offset != at:
            return None
        parts.append(piece.kernel)
        at += piece.kernel.rows
    return concat(parts) if at == rows else None
