"""Compile gpt-oss's variants of the fused MoE kernels (clamped SwiGLU with biases; bf16 and
MXFP4 weights) to CUDA cubins without a GPU (run as a script with TRITON_INTERPRET=0), as
``_gpu_compile.py`` does for the others. Prints one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.kernels._gpu_compile import moe


def main():
    results = []
    # gpt-oss-20b's experts (32, four a token): decode and prefill tiles.
    for variant in ("gpt_oss", "gpt_oss_mxfp4"):
        for tokens in (8, 4096):
            for arch in (90, 80):
                results.extend(moe("bf16", arch, tokens, 4, 32, variant))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
