"""Small helpers shared by the Triton kernel launchers (no Triton code in here)."""

from __future__ import annotations

import functools
import os

import torch


def is_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (a fixed guess when there is none)."""
    if torch.cuda.is_available() and not is_interpreting():
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return 8


def device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return num_sms(idx)
    return num_sms(-1)
