"""GGUF's Q8_0 and Q4_K blocks (llama.cpp's ``block_q8_0``, ``block_q4_K``) taken apart into the
tensors ``conveyor.kernels.quant_gemm``'s GEMMs read: the same bytes, no arithmetic (so no Triton here,
for the loader on any device)."""

from __future__ import annotations

import torch

# GGUF Q8_0: 32 values a block, stored as the fp16 scale then 32 int8s.
Q8_0_BLOCK = 32
Q8_0_BYTES = 2 + Q8_0_BLOCK


def split_q8_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 rows ``[N, K / 32 * 34]`` uint8 -> ``(qs [N, K] int8, d [N, K / 32] fp16)``."""
    n, row_bytes = raw.shape
    assert raw.dtype == torch.uint8 and row_bytes % Q8_0_BYTES == 0
    blocks = raw.reshape(n, row_bytes // Q8_0_BYTES, Q8_0_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, -1)
    qs = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1)
    return qs, d


# GGUF Q4_K: super-blocks of 256 values, stored as fp16 d, fp16 dmin, 12 bytes of eight 6-bit
# scales and mins, then 128 bytes of nibbles.
Q4_K_BLOCK = 256
Q4_K_SCALE_BYTES = 12
Q4_K_BYTES = 2 + 2 + Q4_K_SCALE_BYTES + Q4_K_BLOCK // 2


def split_q4_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_K rows ``[N, K / 256 * 144]`` uint8 -> ``(qs [N, K / 2] uint8, scales
    [N, K / 256 * 12] uint8, d [N, K / 256] fp16, dmin [N, K / 256] fp16)``: the same bytes."""
    n, row_bytes = raw.shape
    assert raw.dtype == torch.uint8 and row_bytes % Q4_K_BYTES == 0
    blocks = raw.reshape(n, row_bytes // Q4_K_BYTES, Q4_K_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
    scales = blocks[..., 4 : 4 + Q4_K_SCALE_BYTES].reshape(n, -1).contiguous()
    qs = blocks[..., 4 + Q4_K_SCALE_BYTES :].reshape(n, -1).contiguous()
    return qs, scales, d, dmin
