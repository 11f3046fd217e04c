"""MoE feed-forward benchmark: the fused Triton kernel (``conveyor.kernels.fused_moe``) vs the
token-sorted torch path (``conveyor.engine.models.moe.moe_sorted``), one layer's experts.

    python -m benchmarks.bench_moe                                # both shapes, 1 .. 4096 tokens
    python -m benchmarks.bench_moe --shapes qwen3-moe --tokens 1 8 64 --dtype float16

Shapes: Mixtral-8x7B-like (8 experts, top-2, hidden 4096, expert inter 14336) and
Qwen3-30B-A3B-like (128 experts, top-8, hidden 2048, expert inter 768). Routing is random
(softmax of normal logits, top-k, renormalised), so experts are loaded about evenly.
For each token count it prints the median time of both paths, the kernel's speed-up, its
TFLOP/s and the bandwidth of reading the experts the batch touches, and the kernel replayed
from a CUDA graph (the way decode runs it: this also proves the path is capturable).
Writes benchmarks/results/moe_<gpu>.json. Needs a CUDA GPU; elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common import gpu_tag, graph_replay_ms, interpret_kernels_without_gpu, median_ms, write_results
from conveyor.engine.models.moe import moe_sorted, route
from conveyor.kernels.interpreter import kernel_device


@dataclass(frozen=True)
class MoEShape:
    experts: int
    top_k: int
    hidden: int
    inter: int


SHAPES = {
    "mixtral": MoEShape(experts=8, top_k=2, hidden=4096, inter=14336),
    "qwen3-moe": MoEShape(experts=128, top_k=8, hidden=2048, inter=768),
}
# The dry run's shape: Qwen3-MoE's routing (many experts, top-8) at a size the interpreter runs.
DRY_RUN_SHAPE = MoEShape(experts=16, top_k=4, hidden=64, inter=32)


def _bench(fn) -> float:
    return median_ms(fn, warmup=5, rep=30)


def run_shape(name: str, shape: MoEShape, tokens: list[int], dtype: torch.dtype, device: str = "cuda") -> list[dict]:
    from conveyor.kernels.fused_moe import choose_tiles, fused_moe

    g = torch.Generator(device=device).manual_seed(0)
    e, h, i = shape.experts, shape.hidden, shape.inter
    w13 = torch.randn(e, 2 * i, h, generator=g, device=device, dtype=dtype) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g, device=device, dtype=dtype) * i**-0.5
    rows = []
    print(f"\n{name}: {asdict(shape)}, {str(dtype)[6:]}")
    hdr = (
        f"{'tokens':>7} {'torch ms':>9} {'kernel ms':>10} {'speedup':>8} {'TFLOP/s':>8} {'GB/s':>7} "
        f"{'graph ms':>9} {'max err':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for n in tokens:
        x = torch.randn(n, h, generator=g, device=device, dtype=dtype)
        logits = torch.randn(n, e, generator=g, device=device)
        weights, ids = route(logits, shape.top_k, renormalize=True, weight_dtype=torch.float32)
        want = moe_sorted(x, w13, w2, weights, ids)
        got = fused_moe(x, w13, w2, weights, ids)
        err = (got.float() - want.float()).abs().max().item()
        torch_ms = _bench(functools.partial(moe_sorted, x, w13, w2, weights, ids))
        kernel_ms = _bench(functools.partial(fused_moe, x, w13, w2, weights, ids))
        graph_ms = graph_replay_ms(functools.partial(fused_moe, x, w13, w2, weights, ids))
        touched = int(torch.unique(ids).numel())
        flops = 2 * n * shape.top_k * 3 * h * i
        weight_bytes = touched * 3 * h * i * w13.element_size()
        row = {
            "tokens": n,
            "torch_ms": torch_ms,
            "kernel_ms": kernel_ms,
            "speedup": torch_ms / kernel_ms,
            "kernel_tflops": flops / (kernel_ms * 1e-3) / 1e12,
            "kernel_weight_gbs": weight_bytes / (kernel_ms * 1e-3) / 1e9,
            "experts_touched": touched,
            "graph_ms": graph_ms,
            "max_abs_err_vs_torch": err,
            "block_m": choose_tiles(n, shape.top_k, e).block_m,
        }
        rows.append(row)
        graph = f"{graph_ms:9.3f}" if isinstance(graph_ms, float) else f"{'failed':>9}"
        print(
            f"{n:>7} {torch_ms:9.3f} {kernel_ms:10.3f} {row['speedup']:7.2f}x {row['kernel_tflops']:8.1f} "
            f"{row['kernel_weight_gbs']:7.0f} {graph} {err:8.1e}"
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default 1 8 64 256 1024 4096 (dry: 1 7)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default results/moe_<gpu>.json)")
    ap.add_argument("--dry-run", action="store_true", help="without a GPU: a tiny shape in Triton's interpreter")
    args = ap.parse_args(argv)
    interpret_kernels_without_gpu()
    on_gpu = kernel_device() == "cuda"
    if not on_gpu and not args.dry_run:
        print("bench_moe: needs a CUDA GPU (and TRITON_INTERPRET unset) to time the kernel; skipping.")
        return 0

    import triton

    if on_gpu:
        dtype, device, gpu = getattr(torch, args.dtype), "cuda", torch.cuda.get_device_name(0)
        shapes = {name: SHAPES[name] for name in args.shapes}
        tokens = args.tokens or [1, 8, 64, 256, 1024, 4096]
    else:  # (the interpreter computes bf16 wrongly: float32)
        dtype, device, gpu = torch.float32, "cpu", "cpu (dry run)"
        shapes, tokens = {"dry-run": DRY_RUN_SHAPE}, args.tokens or [1, 7]
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}, {platform.python_version()}")
    results = {
        "gpu": gpu,
        "triton": triton.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": {
            name: {**asdict(shape), "rows": run_shape(name, shape, tokens, dtype, device)}
            for name, shape in shapes.items()
        },
    }
    write_results(args.out or f"moe_{gpu_tag() if on_gpu else 'cpu'}.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
