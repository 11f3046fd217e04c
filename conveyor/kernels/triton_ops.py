"""Triton implementations of the kernel ops, with the same signatures as their references
in ``conveyor.kernels.reference`` (attention, KV-cache write, RMSNorm, SiLU-and-mul).

Importing this module imports Triton. On CPU the kernels only run under the Triton
interpreter, which must be asked for *before* this import: ``TRITON_INTERPRET=1`` in the
environment, or ``conveyor.kernels.interpreter.enable_interpreter()``.
"""

from .fused_ops import rms_norm, silu_and_mul
from .kv_cache_write import write_kv_cache
from .mla_decode import mla_decode
from .paged_attention import choose_num_kv_splits, decode_num_kv_splits, paged_attention

__all__ = [
    "choose_num_kv_splits",
    "decode_num_kv_splits",
    "mla_decode",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]
