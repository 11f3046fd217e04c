"""A checkpoint's FP8 KV cache scales: compressed-tensors' ``self_attn.k_scale`` and
``self_attn.v_scale`` (its ``kv_cache_scheme``, per tensor or per KV head) and the older FP8
checkpoints' ``self_attn.kv_scale`` (one per-tensor scale for both), collected as the loader
reads them, then handed to each layer's ``KVScaleFold`` (this rank's KV heads' under tensor
parallelism). Used only with ``kv_cache_dtype="fp8"``; with the model's dtype in the cache
they are ignored, as vLLM does."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch
from torch import nn

from conveyor.engine.models.layers import Attention

log = logging.getLogger(__name__)

_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")


class CheckpointKVScales:
    def __init__(self, num_kv_heads: int) -> None:
        self.num_kv_heads = num_kv_heads
        # (layer, "k_scale" or "v_scale") -> its scales, [1] (per tensor) or [num_kv_heads]
        self.scales: dict[tuple[int, str], torch.Tensor] = {}

    def take(self, name: str, read: Callable[[None], torch.Tensor]) -> bool:
        """Whether ``name`` is a KV cache scale (then kept: ``read(None)`` gives the tensor)."""
        match = _NAME.match(name)
        if match is None:
            return False
        scale = read(None).float().reshape(-1)
        if scale.numel() not in (1, self.num_kv_heads):
            raise ValueError(
                f"{name}: {scale.numel()} scales; a KV cache scale is one per tensor or one per KV head "
                f"({self.num_kv_heads})"
            )
        if not bool(torch.all(torch.isfinite(scale) & (scale > 0))):
            raise ValueError(f"{name}: a KV cache scale must be finite and positive, got {scale.tolist()}")
        layer, kind = int(match[1]), match[2]
        for key in ("k_scale", "v_scale") if kind == "kv_scale" else (kind,):
            self.scales[(layer, key)] = scale
        return True

    def install(self, model: nn.Module, kv_cache_dtype: str) -> None:
        """Each layer's scales into its attention, where the cache is FP8."""
        if not self.scales:
            return
        layers = sorted({layer for layer, _ in self.scales})
        if kv_cache_dtype != "fp8":
            log.info(
                "the checkpoint's FP8 KV cache scales are ignored: kv_cache_dtype is %r, not 'fp8'", kv_cache_dtype
            )
            return
        for layer in layers:
            prefix = f"model.layers.{layer}.self_attn"
            k_scale, v_scale = self.scales.get((layer, "k_scale")), self.scales.get((layer, "v_scale"))
            if k_scale is None or v_scale is None:
                raise ValueError(
                    f"{prefix}: a KV cache scale for one of K and V only (k_scale and v_scale go together)"
                )
            attn = _attention(model, layer)
            # A layer whose own forward does not fold the scales in would read e4m3 at scale 1: wrong.
            if not isinstance(attn, Attention) or type(attn).forward is not Attention.forward:
                raise ValueError(
                    f"{prefix}: this model's attention ({type(attn).__name__}) does not apply a checkpoint's FP8 "
                    "KV cache scales (k_scale/v_scale); use kv_cache_dtype='auto' (the scales are then unused)"
                )
            start, heads = attn.heads.kv_head_start, attn.num_kv_heads
            attn.kv_scales.set(
                _rank_heads(k_scale, start, heads),
                _rank_heads(v_scale, start, heads),
                attn.num_heads,
                attn.qkv_weight.dtype,
            )
        log.info("FP8 KV cache with the checkpoint's scales in %d layers", len(layers))


def _attention(model: nn.Module, layer: int) -> nn.Module | None:
    try:
        return model.get_submodule(f"layers.{layer}.self_attn")
    except AttributeError:
        return None


def _rank_heads(scale: torch.Tensor, start: int, heads: int) -> torch.Tensor:
    """This rank's KV heads' scales, ``[heads]``."""
    return scale.expand(heads) if scale.numel() == 1 else scale[start : start + heads]
