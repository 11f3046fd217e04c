"""Which part of each weight a tensor-parallel rank holds, and whether a model can be split.

Column-parallel layers (q/k/v, gate/up) keep a rank's output rows: its query heads, its KV
heads, its slice of the intermediate dim. Row-parallel layers (o_proj, down_proj) keep the
matching input columns; their partial outputs are summed over the ranks. The embedding and
the LM head keep a rank's vocabulary rows, padded to the same count on every rank. With
fewer KV heads than ranks, each KV head is replicated on the ranks whose query heads use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from conveyor.engine.distributed.parallel_state import ParallelState

if TYPE_CHECKING:
    from conveyor.engine.models.model_config import ModelSpec


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank loads: along ``dim``, these ``(start, size)``
    ranges, concatenated in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def rows(cls, start: int, size: int) -> Shard:
        return cls(0, ((start, size),))

    @classmethod
    def cols(cls, start: int, size: int) -> Shard:
        return cls(1, ((start, size),))

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.read(tuple(tensor.shape), lambda: tensor, lambda start, size: tensor.narrow(self.dim, start, size))

    def read(
        self,
        shape: tuple[int, ...],
        whole: Callable[[], torch.Tensor],
        part: Callable[[int, int], torch.Tensor],
    ) -> torch.Tensor:
        """This shard of a tensor of ``shape`` that is read with ``whole()`` or, a range along
        ``dim`` at a time, with ``part(start, size)`` (a checkpoint file can read just those)."""
        ranges = merged_ranges(self.ranges)
        if len(ranges) == 1 and ranges[0] == (0, shape[self.dim]):
            return whole()  # the whole tensor (always so at world size 1)
        for start, size in ranges:
            if start + size > shape[self.dim]:
                raise ValueError(
                    f"shape {shape} has no [{start}, {start + size}) along dim {self.dim}; it does not match the config"
                )
        parts = [part(start, size) for start, size in ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def merged_ranges(ranges: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """The ranges with each one that continues the previous joined to it."""
    out: list[tuple[int, int]] = []
    for start, size in ranges:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((start, size))
    return out


# A checkpoint tensor's place in our model: (our tensor, row offset, rows), and under tensor
# parallelism the ``Shard`` of the checkpoint tensor this rank takes.
WeightSlot = tuple[torch.Tensor, int, int] | tuple[torch.Tensor, int, int, Shard]


@dataclass(frozen=True)
class HeadShard:
    """A rank's attention heads: ``num_heads`` query heads from ``head_start`` and
    ``num_kv_heads`` KV heads from ``kv_head_start`` (of the model's)."""

    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int


def head_shard(num_heads: int, num_kv_heads: int, tp: ParallelState) -> HeadShard:
    n, r = tp.world_size, tp.rank
    heads = num_heads // n
    if num_kv_heads >= n:
        kv = num_kv_heads // n
        return HeadShard(heads, r * heads, kv, r * kv)
    # Fewer KV heads than ranks: n / num_kv_heads consecutive ranks share one KV head, the one
    # their query heads are grouped with.
    return HeadShard(heads, r * heads, 1, r // (n // num_kv_heads))


def local_kv_heads(num_kv_heads: int, world_size: int) -> int:
    """The KV heads one rank caches."""
    return max(1, num_kv_heads // world_size)


def split(size: int, tp: ParallelState) -> tuple[int, int]:
    """A rank's (start, size) of a dim split evenly over the ranks."""
    part = size // tp.world_size
    return tp.rank * part, part


@dataclass(frozen=True)
class VocabShard:
    start: int  # the first token id this rank holds
    rows: int  # how many real rows it holds
    padded: int  # the rows every rank allocates (the vocabulary divided up, rounded up)


def vocab_shard(vocab_size: int, tp: ParallelState) -> VocabShard:
    padded = -(-vocab_size // tp.world_size)
    start = min(vocab_size, tp.rank * padded)
    return VocabShard(start, min(padded, vocab_size - start), padded)


def check_tensor_parallel(spec: ModelSpec, world_size: int) -> None:
    """``ValueError`` naming what does not split over ``world_size`` ranks."""
    if world_size == 1:
        return
    problems = []
    if spec.num_heads % world_size:
        problems.append(f"num_attention_heads {spec.num_heads}")
    kv = spec.num_kv_heads
    if kv % world_size and world_size % kv:
        problems.append(f"num_key_value_heads {kv} (nor does {world_size} divide by it)")
    moe = spec.moe
    if (moe is None or len(moe.sparse_layers) < spec.num_layers) and spec.intermediate_size % world_size:
        problems.append(f"intermediate_size {spec.intermediate_size}")
    if moe is not None and moe.intermediate_size % world_size:
        problems.append(f"the experts' intermediate size {moe.intermediate_size}")
    if moe is not None and moe.shared_intermediate_size % world_size:
        problems.append(f"shared_expert_intermediate_size {moe.shared_intermediate_size}")
    if spec.gemma4 is not None:  # (each layer kind's KV heads, the MoE block's experts)
        problems += spec.gemma4.tensor_parallel_problems(world_size, local_kv_heads(kv, world_size) * spec.head_dim)
    if spec.linear_attention is not None:  # (a hybrid model's linear-attention heads)
        problems += spec.linear_attention.tensor_parallel_problems(world_size)
    if problems:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not divide the model's {', '.join(problems)}; "
            "pick a size that divides them"
        )
