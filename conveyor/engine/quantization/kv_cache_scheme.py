"""compressed-tensors' ``kv_cache_scheme``: what it may say for the checkpoint's static FP8
scales (``self_attn.k_scale``/``v_scale``, applied by ``conveyor.engine.models.kv_scales``); anything
else is refused naming the option."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from conveyor.engine.quantization.base import check_options, refuse

_KV_OPTIONS = (
    "num_bits",
    "type",
    "strategy",
    "symmetric",
    "dynamic",
    "group_size",
    "block_structure",
    "actorder",
    "observer",
    "observer_kwargs",
    "scale_dtype",
    "zp_dtype",
)
# option -> (the values we apply, said as the refusal says them)
_REQUIRED: dict[str, tuple[tuple[Any, ...], str]] = {
    "num_bits": ((8,), "8"),
    "type": (("float",), "float (e4m3)"),
    "symmetric": ((True, None), "true"),
    "dynamic": ((False, None), "false (static scales from the checkpoint)"),
    "strategy": (("tensor", "attn_head", None), "tensor or attn_head"),
    "group_size": ((None,), "none"),
    "block_structure": ((None,), "none"),
    "actorder": ((None,), "none"),
}


def check_kv_cache_scheme(method: str, scheme: Mapping[str, Any]) -> None:
    """Raise unless ``scheme`` is static symmetric FP8 with per-tensor or per-KV-head scales."""
    check_options(f"{method} kv_cache_scheme", scheme, _KV_OPTIONS)
    for option, (allowed, said) in _REQUIRED.items():
        if scheme.get(option) not in allowed:
            raise refuse(method, f"kv_cache_scheme.{option}", scheme.get(option), said)
