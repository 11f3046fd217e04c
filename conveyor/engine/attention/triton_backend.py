"""The ``triton`` attention backend: the engine's attention through our Triton kernels.

Each layer writes its new K/V into the paged cache with ``conveyor.kernels.triton_ops.write_kv_cache``
and attends with ``conveyor.kernels.triton_ops.paged_attention``: one launch (plus a split-KV
reduction for small decode batches) serves the whole flat batch, decodes, prefill chunks and
prefills over a cached prefix alike, with no per-request host work and no host sync.

Triton is an optional dependency (``conveyor[triton]``): this module imports without it,
``triton_available`` says whether the backend can be used, and the kernels (and with them
Triton) are imported only when a backend is made for a device. On CUDA the kernels are
compiled. On any other device they can only run in Triton's CPU interpreter (slow: for tests
and comparisons, not for serving), which Triton selects when a jit function is *decorated*,
triton's own included: ``TRITON_INTERPRET=1`` must be set before the process first imports
``triton``. ``prepare_interpreter`` sets it when Triton is not imported yet (the engine calls
it before loading the tokenizer, since transformers may import Triton); when that is too
late, the backend refuses with a message saying so.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from types import ModuleType

import torch

from conveyor.engine.attention.base import AttentionBackend, AttentionMetadata
from conveyor.kernels.interpreter import enable_interpreter, is_interpreting, kernels_interpreted

log = logging.getLogger(__name__)


def triton_available() -> bool:
    """Whether the triton package is installed (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def prepare_interpreter(device: torch.device) -> None:
    """Off CUDA, choose Triton's CPU interpreter while that is still possible (before the
    process first imports ``triton``)."""
    if device.type == "cuda" or "triton" in sys.modules:
        return
    if not is_interpreting():
        log.info("attention_backend='triton' on %s: running the kernels in Triton's interpreter", device)
        enable_interpreter()


def _load_kernels(device: torch.device) -> ModuleType:
    """Import ``conveyor.kernels.triton_ops`` for ``device`` (under the interpreter unless CUDA)."""
    prepare_interpreter(device)
    # Imported here, not at the top: it imports Triton, which is optional and must come after
    # the interpreter choice just made.
    import conveyor.kernels.triton_ops as ops

    if device.type != "cuda" and not kernels_interpreted():
        raise RuntimeError(
            f"attention_backend='triton' on {device.type} runs the kernels in Triton's CPU "
            "interpreter, but triton was imported before TRITON_INTERPRET=1 was set, so they are "
            "compiled for a GPU; set TRITON_INTERPRET=1 in the environment (or use "
            "attention_backend='torch')"
        )
    return ops


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device | str) -> None:
        # Key splits of the decode kernel: None = chosen per step from the batch shape. A
        # captured CUDA graph bakes in the count at capture, so a graph runner may pin it.
        self.num_kv_splits: int | None = None
        # Loaded now, so that a bad setup fails here rather than at the first step.
        self._ops = _load_kernels(torch.device(device))

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta, ops = self.meta, self._ops
        ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.dtype != k_cache.dtype and k_cache.dtype != torch.float8_e4m3fn:  # (FP8 is read into q's dtype)
            q = q.to(k_cache.dtype)
        return ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
            num_kv_splits=self.num_kv_splits,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
        )

    def mla_decode(self, q: torch.Tensor, latent_cache: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
        meta, nd = self.meta, self.meta.num_decodes
        return self._ops.mla_decode(
            q,
            latent_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            scale,
            kv_lora_rank,
            max_seq_len=max(meta.seq_lens_host[:nd]),
        )

    def decode_kv_splits(self, num_seqs: int, num_q_heads: int, k_cache: torch.Tensor, max_seq_len: int) -> int:
        """Key splits for a decode batch of ``num_seqs`` with contexts up to ``max_seq_len``
        (what a graph runner pins in ``num_kv_splits`` for a captured batch size)."""
        _, _, num_kv_heads, head_dim = k_cache.shape
        return self._ops.decode_num_kv_splits(
            num_seqs, num_q_heads, num_kv_heads, head_dim, k_cache.dtype, max_seq_len, k_cache.device
        )
