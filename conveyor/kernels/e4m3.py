"""e4m3fn (FP8: sign, four exponent bits biased by 7, three mantissa bits; no infinities,
largest 448) converted in arithmetic inside Triton kernels, for GPUs without the e4m3 type
(before sm_89): the bytes are loaded and stored as uint8."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def e4m3_to_float(bits):
    """e4m3fn bytes (as uint8) to float32: ``(8 + m) * 2**(e - 10)``, subnormals ``m * 2**-9``."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 0xF
    m = (b & 0x7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def float_to_e4m3(x):
    """float32 to e4m3fn bytes (uint8), rounded to nearest even and saturated at +-448 (as
    the GPUs' own conversion, ``cvt.rn.satfinite``, does)."""
    a = tl.minimum(tl.abs(x), 448.0)
    # The exponent of ``a`` (at least -6, below which e4m3 is subnormal, spaced 2**-9).
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = tl.exp2((e - 3).to(tl.float32))  # e4m3's spacing at that exponent
    # ``a / step`` (exact: a power of two) rounded to nearest even by float32 addition.
    q = ((a / step + 8388608.0) - 8388608.0).to(tl.int32)
    # Normal: exponent field e + 7, mantissa q - 8 (q = 16 carries into the exponent);
    # subnormal (e = -6, q < 8): exponent field 0, mantissa q. Both are (e + 6) * 8 + q.
    byte = (e + 6) * 8 + q
    negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 too
    return tl.where(negative, byte | 0x80, byte).to(tl.uint8)


def e4m3_in_arithmetic(device: torch.device) -> bool:
    """Whether the GPU lacks the e4m3 type (compute capability below 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def e4m3_encoded_in_arithmetic(device: torch.device) -> bool:
    """Whether values are stored as e4m3 in arithmetic: on GPUs without the type, and in
    Triton's CPU interpreter, whose conversion to e4m3 truncates instead of rounding."""
    return device.type != "cuda" or e4m3_in_arithmetic(device)
