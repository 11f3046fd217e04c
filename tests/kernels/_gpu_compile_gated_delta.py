"""Compile the gated delta rule's kernels to CUDA cubins without a GPU (run as a script with
TRITON_INTERPRET=0), as ``_gpu_compile.py`` does for the others, at Qwen3.5-9B's linear-attention
shapes (16 key heads, 32 value heads, 128-dim keys and values). Prints one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from triton.backends.compiler import GPUTarget

from conveyor.kernels.gated_delta_triton import (
    DECODE_BV,
    PREFILL_BK,
    PREFILL_BV,
    PREFILL_CHUNK,
    PREFILL_WARPS,
    _conv_update_kernel,
    _delta_decode_kernel,
    _delta_prefill_kernel,
)
from tests.kernels._gpu_compile import _compile, _spill_bytes

# Qwen3.5-9B: linear_num_key_heads 16, linear_num_value_heads 32, key and value head dims 128.
REP, DK, DV = 2, 128, 128
# The prefill with speculative decoding's snapshots: its default num_speculative_tokens.
NSNAP = 4


def delta(kind: str, dt: str, arch: int) -> dict:
    """One kernel as the model launches it: q, k and g in float32 (the model computes them so), v,
    beta and the output in the model's dtype, the states in float32; ``prefill_snapshots``: the
    prefill that also leaves speculative decoding's snapshots."""
    fn = _delta_decode_kernel if kind == "decode" else _delta_prefill_kernel
    types = dict(
        q_ptr="*fp32",
        k_ptr="*fp32",
        v_ptr="*" + dt,
        g_ptr="*fp32",
        beta_ptr="*" + dt,
        state_ptr="*fp32",
        slot_ptr="*i64",
        fresh_ptr="*i8",
        seq_start_ptr="*i32",
        out_ptr="*" + dt,
        snap_ptr="*fp32",
        pos_ptr="*i64",
    )
    consts: dict[str, int] = dict(REP=REP, DK=DK, DV=DV)
    if kind == "decode":
        consts.update(BK=DK, BV=DECODE_BV)
    else:
        consts.update(BK=PREFILL_BK, BV=PREFILL_BV, BT=PREFILL_CHUNK, NSNAP=NSNAP if kind == "prefill_snapshots" else 0)
    warps = 4 if kind == "decode" else PREFILL_WARPS
    strides = [n for n in fn.arg_names if n.startswith("stride_")]
    k = _compile(fn, types, consts, GPUTarget("cuda", arch, 32), div16=strides, num_warps=warps)
    return dict(kernel=f"gated_delta/{kind}", dtype=dt, arch=arch, shared=k.metadata.shared, spill=_spill_bytes(k))


def conv_update(dt: str, arch: int) -> dict:
    """The conv's decode update over Qwen3.5-9B's 8192 conv channels (q, k, v), 4 taps."""
    types = dict(x_ptr="*" + dt, w_ptr="*" + dt, state_ptr="*" + dt, slot_ptr="*i64", fresh_ptr="*i8", out_ptr="*" + dt)
    strides = ["stride_x", "stride_o", "stride_ss", "channels"]
    k = _compile(_conv_update_kernel, types, dict(K=4, BK=4, BC=256), GPUTarget("cuda", arch, 32), div16=strides,
                 num_warps=4)  # fmt: skip
    return dict(kernel="gated_delta/conv_update", dtype=dt, arch=arch, shared=k.metadata.shared, spill=_spill_bytes(k))


def main() -> None:
    # The prefills (8 to 13 s of ptxas each) in bf16 only: the model's dtype changes just the
    # loads of v and beta and the output's store, every product and the state are float32 in both.
    results = [delta("decode", dt, arch) for dt in ("bf16", "fp32") for arch in (90, 80)]
    results += [delta(kind, "bf16", arch) for kind in ("prefill", "prefill_snapshots") for arch in (90, 80)]
    results += [conv_update(dt, arch) for dt in ("bf16", "fp32") for arch in (90, 80)]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
