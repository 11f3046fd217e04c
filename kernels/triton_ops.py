"""Triton implementations of the kernel ops, with the same signatures as
``kernels.reference`` (attention, KV-cache write) and ``kernels.reference_extra``
(RMSNorm, SiLU-and-mul).

Importing this module imports Triton. On CPU the kernels only run under the Triton
interpreter: set ``TRITON_INTERPRET=1`` in the environment *before* this import.
"""

from .fused_ops import rms_norm, silu_and_mul
from .kv_cache_write import write_kv_cache
from .paged_attention import choose_num_kv_splits, decode_num_kv_splits, paged_attention

__all__ = ["write_kv_cache", "paged_attention", "choose_num_kv_splits",
           "decode_num_kv_splits", "rms_norm",
           "silu_and_mul"]
