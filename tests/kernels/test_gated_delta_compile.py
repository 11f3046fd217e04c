"""The gated delta rule's kernels (the prefill with and without speculative decoding's
snapshots) compile for real GPUs (sm_90, sm_80) at Qwen3.5-9B's shapes without register spills,
checked on CPU as ``test_gpu_compile`` does for the other kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_gated_delta_kernels_compile_without_spills():
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton's bundled ptxas is not available")
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = str(HERE / "_gpu_compile_gated_delta.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["kernel"], r["arch"]) for r in results} == {
        (f"gated_delta/{kind}", arch)
        for kind in ("decode", "prefill", "prefill_snapshots", "conv_update")
        for arch in (90, 80)
    }
    for r in results:
        assert r["shared"] <= 100 * 1024, r
        if r["spill"] is not None:
            assert r["spill"] == 0, f"register spills: {r}"
