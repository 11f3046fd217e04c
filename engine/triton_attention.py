"""The ``triton`` attention backend: the engine's attention through our Triton kernels.

Each layer writes its new K/V into the paged cache with ``kernels.triton_ops.write_kv_cache``
and attends with ``kernels.triton_ops.paged_attention``: one launch (plus a split-KV
reduction for small decode batches) serves the whole flat batch, decodes, prefill chunks and
prefills over a cached prefix alike, with no per-request host work and no host sync.

Triton is imported lazily, once the device is known. On CUDA the kernels are compiled. On any
other device they can only run in Triton's CPU interpreter (slow: for tests and comparisons,
not for serving), which Triton selects when a jit function is *decorated*, triton's own
included: ``TRITON_INTERPRET=1`` must be set before the process first imports ``triton``.
This module sets it when Triton is not imported yet, but transformers usually imports Triton
while the engine loads the tokenizer, so in practice set it in the environment (the test
suite's root conftest does); otherwise the backend refuses with a message saying so.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from types import ModuleType

import torch

from engine.attention import AttentionBackend, AttentionMetadata


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


# ``engine.attention.create_backend`` treats an ImportError of this module as "no triton".
if not _triton_installed():
    raise ImportError("the triton package is not installed (pip install 'conveyor[triton]')")

log = logging.getLogger(__name__)

_INTERPRET_VALUES = ("1", "true", "yes", "on")


def load_kernels(device: torch.device) -> ModuleType:
    """Import ``kernels.triton_ops`` for ``device`` (under the interpreter unless CUDA)."""
    if device.type != "cuda":
        if "triton" not in sys.modules:
            if os.environ.get("TRITON_INTERPRET", "0").lower() not in _INTERPRET_VALUES:
                log.info("attention_backend='triton' on %s: running the kernels in Triton's interpreter", device)
            os.environ["TRITON_INTERPRET"] = "1"
        elif not _interpreting():
            raise RuntimeError(
                f"attention_backend='triton' on {device.type} runs the kernels in Triton's CPU "
                "interpreter, but triton was imported before TRITON_INTERPRET=1 was set; set "
                "TRITON_INTERPRET=1 in the environment (or use attention_backend='torch')"
            )
    import kernels.triton_ops as ops

    if device.type != "cuda" and not _interpreting():
        raise RuntimeError(
            "kernels.triton_ops was compiled for a GPU (imported before TRITON_INTERPRET=1 was "
            f"set) and cannot run on {device.type}; set TRITON_INTERPRET=1 in the environment"
        )
    return ops


def _interpreting() -> bool:
    """True when Triton's jit functions (triton's own and ours) run in the interpreter."""
    import triton.language as tl

    def interpreted(fn) -> bool:
        return "Interpreted" in type(fn).__name__

    std = getattr(tl, "cdiv", None)  # a @jit function of triton's standard library
    if hasattr(std, "fn") and not interpreted(std):
        return False
    module = sys.modules.get("kernels.paged_attention")
    return module is None or interpreted(module._paged_attn_kernel)


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device | str | None = None) -> None:
        # Key splits of the decode kernel: None = chosen per step from the batch shape. A
        # captured CUDA graph bakes in the count at capture, so a graph runner may pin it.
        self.num_kv_splits: int | None = None
        self.meta: AttentionMetadata | None = None
        self._ops: ModuleType | None = None
        # Import (and fail on a bad setup) now rather than on the first step when the device
        # is known: given, or necessarily not CUDA.
        if device is None and not torch.cuda.is_available():
            device = "cpu"
        if device is not None:
            self._ops = load_kernels(torch.device(device))

    def prepare(self, meta: AttentionMetadata) -> None:
        if self._ops is None:
            self._ops = load_kernels(meta.slot_mapping.device)
        self.meta = meta

    def forward(self, q, k, v, k_cache, v_cache, scale):
        meta, ops = self.meta, self._ops
        ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.dtype != k_cache.dtype:
            q = q.to(k_cache.dtype)
        return ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            scale, meta.max_query_len, meta.max_seq_len, num_kv_splits=self.num_kv_splits,
        )

    def decode_kv_splits(self, num_seqs: int, num_q_heads: int, k_cache: torch.Tensor, max_seq_len: int) -> int:
        """Key splits for a decode batch of ``num_seqs`` with contexts up to ``max_seq_len``
        (what a graph runner pins in ``num_kv_splits`` for a captured batch size)."""
        if self._ops is None:
            self._ops = load_kernels(k_cache.device)
        _, _, num_kv_heads, head_dim = k_cache.shape
        return self._ops.decode_num_kv_splits(
            num_seqs, num_q_heads, num_kv_heads, head_dim, k_cache.dtype, max_seq_len, k_cache.device
        )
