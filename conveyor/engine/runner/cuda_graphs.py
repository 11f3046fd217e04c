"""CUDA graphs for decode batches.

A decode step runs a few dozen small kernels per layer for a handful of tokens each; on a
GPU the host launching them, not the GPU running them, sets the pace. So a decode batch's
whole forward pass is captured once per batch-size bucket (1, 2, 4, then multiples of 8)
and replayed with one launch per step.

A graph replays fixed kernels on fixed addresses. Each step therefore writes its batch into
static buffers, padded up to the bucket: a padded row is token 0 at position 0 with slot -1
(the KV write skips it) and context length 0 (attention reads nothing for it), and its
output is dropped. Only the ``triton`` attention backend can be captured: its kernels take
every length and offset from device tensors and never wait on the host. The one choice it
makes on the host, the number of key splits of the decode kernel, is pinned per bucket for
the longest context the engine allows (a split count is valid for any context length).

The logits and the sampler run outside the graph, on the real rows only.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from conveyor.engine.attention.base import AttentionBackend, AttentionMetadata
from conveyor.engine.attention.triton_backend import TritonAttention
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.kernels.utils import cdiv

log = logging.getLogger(__name__)


def graphs_apply(device: torch.device, enforce_eager: bool, reasons_not: dict[str, bool]) -> bool:
    """Whether decode batches replay CUDA graphs: on CUDA unless ``enforce_eager``, and only
    when none of ``reasons_not`` (a reason to log -> whether it holds) holds."""
    if device.type != "cuda" or enforce_eager:
        return False
    for reason, holds in reasons_not.items():
        if holds:
            log.info(reason)
            return False
    return True


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The captured buckets: 1, 2, 4, then every multiple of 8 up to ``max_batch_size``
    (included even when it is not a multiple of 8)."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch_size]
    sizes += list(range(8, max_batch_size + 1, 8))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


class Graph(Protocol):
    """What the runner needs of a graph: capture a callable once, replay it later."""

    def capture(self, fn: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


class CallingGraph:
    """A graph that replays by calling the captured function again: the CPU stand-in for a
    CUDA graph, so tests and dry runs take the graph runner's path (static buffers, padding,
    pinned key splits) without a GPU."""

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        fn()

    def replay(self) -> None:
        self.fn()


class CudaGraph:
    """A ``torch.cuda.CUDAGraph``; all of a runner's graphs share one memory pool, and they
    are captured largest first so the smaller ones reuse its memory."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], None]) -> None:
        fn()  # warm-up outside the graph: compiles the Triton kernels, sets up cuBLAS
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool):
            fn()
        torch.cuda.synchronize()

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """Captured decode forwards, one per bucket, over shared static input/output buffers."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_batch_size: int,
        max_seq_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        graph_factory: Callable[[], Graph] | None = None,
    ) -> None:
        if not isinstance(backend, TritonAttention):
            raise ValueError("CUDA graphs need the triton attention backend")
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError("CUDA graphs are for native models, not the transformers fallback")
        self.model: LlamaForCausalLM = model
        self.backend: TritonAttention = backend
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.max_seq_len = max_seq_len
        self.max_blocks = cdiv(max_seq_len, block_size)
        if graph_factory is None:
            pool = torch.cuda.graph_pool_handle()
            graph_factory = functools.partial(CudaGraph, pool)
        self._graph_factory = graph_factory
        self.graphs: dict[int, Graph] = {}
        self.replays: Counter[int] = Counter()  # bucket -> steps replayed
        n = self.max_batch_size
        with torch.inference_mode():
            # Rows: token ids, positions, slots, context lengths. One int64 buffer, so a
            # step is one host-to-device copy plus one for the block tables.
            self._io = torch.zeros((4, n), dtype=torch.long, device=device)
            self._block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=device)
            self._query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
            self._hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        # Per bucket: the split count pinned in the decode kernel.
        num_q_heads = model.spec.num_heads
        self._splits = {
            bs: backend.decode_kv_splits(bs, num_q_heads, kv_caches[0][0], max_seq_len) for bs in self.sizes
        }

    # -------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self._io[2].fill_(-1)  # warm-up and capture write nothing and read nothing
        self._io[3].zero_()
        for bs in reversed(self.sizes):
            graph = self._graph_factory()
            graph.capture(self._forward_fn(bs))
            self.graphs[bs] = graph
        log.info(
            "captured CUDA graphs for decode batches of %s in %.1fs",
            ", ".join(map(str, self.sizes)),
            time.perf_counter() - start,
        )

    def _forward_fn(self, bs: int) -> Callable[[], None]:
        io, backend = self._io[:, :bs], self.backend
        meta = AttentionMetadata(
            slot_mapping=io[2],
            block_tables=self._block_tables[:bs],
            query_start_loc=self._query_start_loc[: bs + 1],
            seq_lens=io[3],  # replaced by an int32 copy inside the graph, below
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            num_decodes=bs,
            query_lens_host=[1] * bs,
            seq_lens_host=[self.max_seq_len] * bs,
        )
        splits = self._splits[bs]

        @torch.inference_mode()
        def forward() -> None:
            meta.seq_lens = io[3].to(torch.int32)
            backend.num_kv_splits = splits
            try:
                backend.prepare(meta)
                self._hidden[:bs] = self.model(io[0], io[1], backend, self.kv_caches)
            finally:
                backend.num_kv_splits = None

        return forward

    # -------------------------------------------------------------------------------
    def bucket_for(self, num_seqs: int, max_table_len: int) -> int | None:
        """The smallest captured batch size that holds this decode batch, or None."""
        if not self.graphs or num_seqs > self.max_batch_size or max_table_len > self.max_blocks:
            return None
        for bs in self.sizes:
            if bs >= num_seqs:
                return bs
        return None

    @torch.inference_mode()
    def run(
        self,
        bs: int,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        width: int,
    ) -> torch.Tensor:
        """Replay bucket ``bs`` on a decode batch (``width``: its longest block table); the
        hidden states of its real rows."""
        n = len(input_ids)
        io = np.zeros((4, bs), dtype=np.int64)
        io[0, :n], io[1, :n], io[2, :n], io[3, :n] = input_ids, positions, slots, seq_lens
        io[2, n:] = -1
        block_tables = np.zeros((n, width), dtype=np.int32)
        for row, table in zip(block_tables, tables, strict=True):
            row[: len(table)] = table
        # Padded rows and columns past each table keep stale ids: nothing reads them.
        self._io[:, :bs].copy_(torch.from_numpy(io))
        self._block_tables[:n, :width].copy_(torch.from_numpy(block_tables))
        self.graphs[bs].replay()
        self.replays[bs] += 1
        return self._hidden[:n]
