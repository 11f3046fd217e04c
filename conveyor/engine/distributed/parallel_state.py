"""This process's place in the tensor-parallel group, and the collectives the layers use.

Layers read ``current()`` when they are built and keep it, so a single-process engine (world
size 1, the default) runs exactly the code it ran before: every collective below is the
identity at world size 1. Rank 0 and the ranks it starts set the state with ``set_state``
before building the model and clear it at shutdown.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # the torch.distributed process group (None at world size 1)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def device_for(self, device: torch.device) -> torch.device:
        """This rank's device: on CUDA, one GPU per rank."""
        return torch.device("cuda", self.rank) if self.enabled and device.type == "cuda" else device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def row_parallel_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` where each rank holds a slice of ``weight``'s columns (and
        ``x``'s): the partial products summed over the ranks, the bias added once after."""
        if self.world_size == 1:
            return F.linear(x, weight, bias)
        out = self.all_reduce(F.linear(x, weight))
        return out if bias is None else out + bias

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place (``x`` is contiguous and of one shape on all)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.broadcast(x, src=0, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along the last dim, on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' ``value``s (what every rank can agree on)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = ParallelState()
_state = SINGLE


def current() -> ParallelState:
    return _state


def set_state(state: ParallelState) -> None:
    global _state
    _state = state


def reset() -> None:
    set_state(SINGLE)


@contextmanager
def single_process() -> Iterator[None]:
    """Layers built inside run alone in this process, whatever its tensor-parallel state (a
    draft model on rank 0 beside a split target: its forward passes involve no other rank)."""
    global _state
    saved, _state = _state, SINGLE
    try:
        yield
    finally:
        _state = saved
