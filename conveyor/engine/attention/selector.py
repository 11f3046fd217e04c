"""Which attention backend an engine runs: ``auto`` is ``triton`` on CUDA when Triton is
installed (the compiled kernels read the paged cache in place), ``torch`` everywhere else."""

from __future__ import annotations

import torch

from conveyor.engine.attention.base import AttentionBackend
from conveyor.engine.attention.torch_backend import TorchAttention
from conveyor.engine.attention.triton_backend import TritonAttention, triton_available
from conveyor.engine.config import ATTENTION_BACKENDS


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` (one of ``ATTENTION_BACKENDS``) for a model on ``device``
    (both read a KV cache of the model's dtype or FP8)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package (pip install 'conveyor[triton]')")
        return TritonAttention(device)
    raise ValueError(f"unknown attention backend {name!r}; expected one of {ATTENTION_BACKENDS}")
