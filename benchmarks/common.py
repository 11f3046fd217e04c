"""Shared helpers for the benchmarks: machine info, the benchmark model, result files."""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.testing import build_tiny_model

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def gpu_tag() -> str:
    """The GPU's name as a file-name tag (``nvidia_h100_80gb_hbm3``)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(0)).strip("_").lower()


def bench_model(name: str = "conveyor-bench-llama", **overrides: int) -> Path:
    """A small random-weight Llama (``overrides``: its sizes), built once into the temp directory."""
    path = Path(tempfile.gettempdir()) / name
    if not (path / "config.json").exists():
        kwargs: dict[str, Any] = dict(
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=768,
            max_position_embeddings=2048,
        )
        kwargs.update(overrides)
        build_tiny_model(path, "llama", **kwargs)
    return path


def write_results(name: str, results: dict[str, Any]) -> Path:
    results["machine"] = machine_info()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / name
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out}")
    return out
