"""The Triton kernels compile for real GPUs (sm_90, sm_80), checked on CPU.

The interpreter accepts code the compiler rejects (and never shows register spills), so
the kernels are also compiled ahead of time to cubins in a subprocess with
TRITON_INTERPRET=0. Needs Triton's bundled NVIDIA toolchain (ptxas); no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_kernels_compile_for_gpu_without_spills():
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not available")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, str(HERE / "_gpu_compile.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    attn = [r for r in results if r["kernel"] == "paged_attention"]
    assert len(attn) >= 10
    assert any(r["window"] and r["softcap"] for r in attn)  # Gemma's layers compiled too
    assert {r["arch"] for r in attn if r["sinks"] and r["window"]} == {90, 80}  # and gpt-oss's
    # FP8 KV caches: the e4m3 type on sm_90, bytes decoded in arithmetic on sm_80
    assert {(r["arch"], r["kv_fp8"]) for r in attn if r["kv_fp8"]} == {(90, 1), (80, 2)}
    for r in attn:
        assert r["shared"] <= 100 * 1024, r  # fits sm_86/sm_89 (and everything larger)
        if r["spill"] is not None:
            assert r["spill"] == 0, f"register spills: {r}"
    latent = [r for r in results if r["kernel"] == "mla_decode"]
    assert {r["arch"] for r in latent} == {90, 80} and any(r["splits"] > 1 for r in latent)
    for r in latent:
        assert r["shared"] <= 100 * 1024, r
        if r["spill"] is not None:
            assert r["spill"] == 0, f"register spills: {r}"
    moe = [r for r in results if r["kernel"].startswith("fused_moe/")]
    assert {r["config"][0] for r in moe} == {16, 64}  # decode and prefill tiles both compiled
    for r in moe:
        assert r["shared"] <= 100 * 1024, r
        if r["spill"] is not None:
            assert r["spill"] == 0, f"register spills: {r}"
