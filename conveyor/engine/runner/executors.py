"""How a built batch runs: the executors. Each runs the forward pass of a ``Batch`` and hands
back ``logits_of(rows)`` for the rows it wants (``Batch.wanted_rows``); the runner picks one
when it starts (``choose_executor``).

- ``EagerExecutor``: the model's forward pass, as is.
- ``CudaGraphExecutor``: a batch of decodes only replays a captured CUDA graph
  (``conveyor.engine.runner.cuda_graphs``); anything else runs eagerly.
- ``TensorParallelExecutor``: rank 0 of tensor parallelism sends the batch to the other ranks
  (``conveyor.engine.distributed``), all run the same forward pass, and the wanted rows' logits are
  gathered on rank 0.
"""

from __future__ import annotations

from typing import Protocol

import torch

from conveyor.engine.distributed.leader import SingleRank
from conveyor.engine.distributed.rank_group import RankGroup
from conveyor.engine.distributed.step_inputs import StepInputs
from conveyor.engine.runner.batch import Batch, LogitsOf
from conveyor.engine.runner.cuda_graphs import DecodeGraphs


class ForwardPass(Protocol):
    """What the executors need of the runner (``ModelRunner``): its eager forward pass, the
    logits of chosen rows of its output, and a tensor-parallel rank's step."""

    def forward_eager(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        counts: list[int],
        tables: list[list[int]],
        num_decodes: int,
    ) -> torch.Tensor: ...

    def logits_of(self, hidden: torch.Tensor) -> LogitsOf: ...

    def run_step(self, inputs: StepInputs) -> torch.Tensor | None: ...


class Executor(Protocol):
    def run(self, batch: Batch) -> LogitsOf | None:
        """Run ``batch``; None when it wants no logits."""
        ...


class EagerExecutor:
    def __init__(self, runner: ForwardPass) -> None:
        self.runner = runner

    def run(self, batch: Batch) -> LogitsOf | None:
        hidden = self.runner.forward_eager(
            batch.input_ids,
            batch.positions,
            batch.slots,
            batch.seq_lens,
            batch.query_lens,
            batch.tables,
            batch.num_decodes,
        )
        return self.runner.logits_of(hidden)


class CudaGraphExecutor:
    def __init__(self, runner: ForwardPass, graphs: DecodeGraphs) -> None:
        self.runner = runner
        self.graphs = graphs
        self.eager = EagerExecutor(runner)

    def run(self, batch: Batch) -> LogitsOf | None:
        num_seqs = len(batch.seq_lens)
        width = max(len(t) for t in batch.tables)
        bucket = self.graphs.bucket_for(num_seqs, width) if batch.num_decodes == num_seqs else None
        if bucket is None:
            return self.eager.run(batch)
        hidden = self.graphs.run(
            bucket, batch.input_ids, batch.positions, batch.slots, batch.seq_lens, batch.tables, width
        )
        return self.runner.logits_of(hidden)


class TensorParallelExecutor:
    def __init__(self, runner: ForwardPass, ranks: RankGroup) -> None:
        self.runner = runner
        self.ranks = ranks

    def run(self, batch: Batch) -> LogitsOf | None:
        wanted = batch.wanted_rows
        inputs = StepInputs(
            batch.input_ids,
            batch.positions,
            batch.slots,
            batch.seq_lens,
            batch.query_lens,
            batch.tables,
            batch.num_decodes,
            wanted,
        )
        with self.ranks.failures():  # a collective failed: say which rank died, if one did
            self.ranks.send_step(inputs)
            logits = self.runner.run_step(inputs)
        if logits is None:
            return None
        index = {row: i for i, row in enumerate(wanted)}
        return lambda rows: logits[torch.tensor([index[r] for r in rows], device=logits.device)]


def choose_executor(runner: ForwardPass, ranks: RankGroup | SingleRank, graphs: DecodeGraphs | None) -> Executor:
    if isinstance(ranks, RankGroup):
        return TensorParallelExecutor(runner, ranks)
    if graphs is not None:
        return CudaGraphExecutor(runner, graphs)
    return EagerExecutor(runner)
