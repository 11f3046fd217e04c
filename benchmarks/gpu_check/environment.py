"""What the GPU check ran on: the GPU, its driver, and the versions of what was imported."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "llguidance", "gguf", "numpy")


# Asked in a child process: a CUDA context in the check's own process would hold GPU memory
# (and count as used) for the whole run.
_GPU_QUERY = """
import json, torch
out = {"torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
                  "memory_gib": round(p.total_memory / 2**30, 1), "count": torch.cuda.device_count()}
print(json.dumps(out))
"""


def describe(commit: str | None = None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": commit,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "packages": {name: _version(name) for name in PACKAGES},
    }
    query = subprocess.run([sys.executable, "-c", _GPU_QUERY], capture_output=True, text=True, timeout=120)
    if query.returncode == 0:
        env.update(json.loads(query.stdout.strip().splitlines()[-1]))
    else:
        env["gpu_query_error"] = query.stderr[-2000:]
    if env.get("cuda_available"):
        env["driver"] = _nvidia_smi("driver_version")
    return env


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
