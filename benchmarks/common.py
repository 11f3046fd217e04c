"""Shared helpers for the benchmarks: machine info, the benchmark model, result files."""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from conveyor.kernels.interpreter import enable_interpreter
from conveyor.testing.tiny_models import build_tiny_model

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


def write_results(name: str | Path, results: dict[str, Any]) -> Path:
    """``results`` with the machine's description, as JSON: ``name`` under ``RESULTS``, or a path."""
    results["machine"] = machine_info()
    out = RESULTS / name  # (an absolute path stays itself)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out}")
    return out


def median_ms(fn: Callable[[], object], *, warmup: int = 5, rep: int = 30, flush_l2: bool = False) -> float:
    """Median milliseconds of ``fn``: timed with CUDA events on a GPU (``flush_l2``: a 256 MiB
    write between runs, so each starts from device memory), with the wall clock on CPU (the
    GPU check's dry run)."""
    if not torch.cuda.is_available():  # a dry run: the kernels are interpreted, a few runs prove the path
        warmup, rep = min(warmup, 1), min(rep, 3)
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(rep):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda") if flush_l2 else None
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        if flush is not None:
            flush.zero_()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(nbytes: int = 2 << 30, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth, bytes read plus written over time: the practical peak
    that memory-bound kernels are measured against."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=3, rep=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def interpret_kernels_without_gpu() -> None:
    """Without CUDA the Triton kernels run only in the interpreter (the GPU check's dry run):
    ask for it, unless the environment chose, before anything imports triton."""
    if not torch.cuda.is_available():
        enable_interpreter(unless_set=True)


def graph_replay_ms(fn: Callable[[], object], *, flush_l2: bool = False) -> float | str:
    """``fn`` captured once in a CUDA graph, then its replays timed (median ms): the GPU's time
    without the host's launch overhead. Off a GPU, or when capture fails, the reason instead."""
    if not torch.cuda.is_available():
        return "no GPU (dry run)"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up (Triton compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:
        return f"capture failed: {e}"
    return median_ms(graph.replay, flush_l2=flush_l2)
