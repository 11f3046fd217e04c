"""What each layer's cache holds per token, and the device tensors that hold it.

Every architecture's cache is ``[num_layers, parts, num_blocks, block_size, heads, width]``,
addressed by the same block ids (``conveyor.engine.kv_cache`` manages them; prefix caching and the
memory budget work in blocks, whatever a block holds). Per-head K/V is ``parts`` 2 (K then V)
of ``num_kv_heads x head_dim``, this rank's heads under tensor parallelism. Multi-head latent
attention (DeepSeek-V3, ``ModelSpec.mla``) caches one part of one "head": each token's
normalised latent then its rope key, which every query head reads (and every rank keeps whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.engine.distributed.sharding import local_kv_heads
from conveyor.engine.models.model_config import ModelSpec

# One layer's cache as the model's attention takes it: (keys, values). A latent cache is one
# tensor in both places: the keys are its rows, the values their first ``kv_lora_rank`` columns.
LayerCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    parts: int  # 2: keys and values; 1: the latent
    heads: int
    width: int

    @classmethod
    def for_model(cls, spec: ModelSpec, world_size: int) -> KVLayout:
        if spec.mla is not None:
            return cls(spec.kv_cache_layers, 1, 1, spec.mla.latent_width)
        return cls(spec.kv_cache_layers, 2, local_kv_heads(spec.num_kv_heads, world_size), spec.head_dim)

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """The bytes one block takes across every layer."""
        per_token = self.num_layers * self.parts * self.heads * self.width
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, list[LayerCache]]:
        """The cache tensor (zeros) and each layer's (keys, values) views of it."""
        if self.parts == 1 and dtype.itemsize == 1:
            raise ValueError("kv_cache_dtype 'fp8' is not supported for multi-head latent attention (DeepSeek-V3)")
        shape = (self.num_layers, self.parts, num_blocks, block_size, self.heads, self.width)
        cache = torch.zeros(shape, dtype=dtype, device=device)
        return cache, [(cache[i, 0], cache[i, self.parts - 1]) for i in range(self.num_layers)]
