"""Integers packed into int32 words, lowest bits first: the layout AWQ, GPTQ and
compressed-tensors all use (AWQ then permutes the eight nibbles of a word)."""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Each int32 of ``packed`` split into ``32 // bits`` unsigned integers along ``dim``,
    element ``i`` of a word from bits ``i*bits`` up: int64, ``32 // bits`` times longer."""
    if bits not in (2, 4, 8):
        raise ValueError(f"{bits}-bit packing is not supported (2, 4 or 8)")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = packed.to(torch.int64).unsqueeze(-1)  # the sign of int32 does not matter once masked
    values = (words >> shifts) & ((1 << bits) - 1)  # [..., per_word]
    values = values.movedim(-1, dim + 1 if dim >= 0 else dim)
    shape = list(packed.shape)
    shape[dim] *= per_word
    return values.reshape(shape)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``unpack_int32``'s inverse along the last dim: ``32 // bits`` unsigned integers a word,
    the first in the lowest bits, as int32 (two's complement)."""
    per_word = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (v << shifts).sum(-1)  # the fields do not overlap: the sum is their bitwise or
    return (words - ((words >> 31) << 32)).to(torch.int32)
