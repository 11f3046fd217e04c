"""Small helpers for the kernel launchers and their callers (no Triton code in here)."""

from __future__ import annotations

import functools

import torch

from .interpreter import is_interpreting


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up (``a >= 0``, ``b > 0``): e.g. the blocks that hold ``a`` tokens."""
    return -(-int(a) // int(b))


@functools.cache
def _num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (a fixed guess when there is none)."""
    if torch.cuda.is_available() and not is_interpreting():
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return 8


def device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return _num_sms(idx)
    return _num_sms(-1)
