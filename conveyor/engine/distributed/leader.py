"""Rank 0's side of tensor parallelism as the runner sees it: ``start_ranks`` starts the other
ranks (a ``RankGroup``), or, with one rank or on a rank that rank 0 started, gives a
``SingleRank`` with the same calls and nothing behind them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.rank_args import RankArgs
from conveyor.engine.distributed.rank_group import RankGroup
from conveyor.engine.distributed.rank_worker import RunnerFactory
from conveyor.engine.distributed.sharding import check_tensor_parallel
from conveyor.engine.models.model_config import ModelSpec

log = logging.getLogger(__name__)


class SingleRank:
    """No other ranks: nothing to start, stop, or blame a failure on."""

    pids: list[int] = []  # noqa: RUF012 (never mutated: no ranks)

    def close(self) -> None:
        pass

    @contextlib.contextmanager
    def failures(self) -> Iterator[None]:
        yield


def start_ranks(
    config: EngineConfig,
    model_spec: ModelSpec,
    model_path: Path,
    max_model_len: int,
    model_impl: str,
    device: torch.device,
    runner_factory: RunnerFactory,
) -> RankGroup | SingleRank:
    """The other ranks of this engine, started, when it is a tensor-parallel engine's rank 0."""
    state = parallel_state.current()
    if state.enabled and state.rank == 0:
        raise RuntimeError("a tensor-parallel engine is already running in this process; shut it down first")
    size = config.parallel.tensor_parallel_size
    if size == 1 or state.enabled:  # (a rank that rank 0 started runs no ranks of its own)
        return SingleRank()
    if model_impl != "native":
        raise ValueError("tensor parallelism needs a native model, not the transformers fallback")
    check_tensor_parallel(model_spec, size)
    if model_spec.linear_attention is not None and config.num_speculative_tokens:
        # (rank 0's memory manager rolls its own state back; the other ranks' would run on)
        raise ValueError(
            "speculative decoding on a hybrid (linear-attention) model is not served under tensor "
            "parallelism: a rejected proposal's state rollback is not sent to the other ranks"
        )
    threads = max(1, torch.get_num_threads() // size)
    if device.type == "cpu":  # the ranks share the cores: more threads each only spin
        log.info("tensor parallelism on CPU: %d torch threads per rank, this process's included", threads)
        torch.set_num_threads(threads)
    args = RankArgs(
        rank=0,
        world_size=size,
        port=0,
        backend="nccl" if device.type == "cuda" else "gloo",
        config=config,
        model_spec=model_spec,
        model_path=model_path,
        max_model_len=max_model_len,
        model_impl=model_impl,
        cpu_threads=threads,
    )
    return RankGroup.start(args, device, runner_factory)
