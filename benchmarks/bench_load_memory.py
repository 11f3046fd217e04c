"""Peak memory while loading a quantized checkpoint whose weights stay quantized: a Llama
(hidden 1024, 8 layers, about 94M parameters in its linear layers) written as GGUF Q8_0,
loaded with the weights kept as Q8_0 blocks (on CPU through Triton's interpreter, as the tests
do; on CUDA the same path runs compiled), in a fresh process each time:

- ``dense-first``: the linear weights built dequantized (float32) and then replaced by the
  packed blocks, as loading did before ``deferred_linears``;
- ``per-tensor``: the linear weights built on the meta device, each tensor's blocks read and
  kept as the loader reaches it (what loading does now).

Reports the process's peak RSS over its RSS before loading (the file is memory-mapped: the
pages read count too) and the bytes the loaded model holds. Writes JSON to benchmarks/results/.

    python benchmarks/bench_load_memory.py [--layers 8] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from benchmarks.common import bench_model, write_results


def _child(path: str, mode: str) -> None:
    import torch

    from conveyor.engine.models import loader
    from conveyor.engine.quantization import kept

    kept.KEEP_ON_CPU = True
    if mode == "dense-first":  # the old load: linears built dequantized, each filled with floats, then packed
        loader.deferred_linears = lambda active: contextlib.nullcontext()  # (the old build)
        take = kept.KeptWeights.take

        def fill_then_take(self, target, offset, rows, read, shard):
            target.data[offset : offset + rows].copy_(read(shard).to(target.dtype))
            return take(self, target, offset, rows, read, shard)

        kept.KeptWeights.take = fill_then_take  # type: ignore[method-assign]
    file = Path(path)
    spec = loader.load_spec(file)[0]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = loader.load_model(file, spec, 256, torch.float32, torch.device("cpu"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    linears = [
        w
        for m in model.modules()
        for name in getattr(m, "quantized_linears", ())
        if isinstance(w := getattr(m, name), kept.QuantizedLinearWeight)
    ]
    packed = sum(w.kernel.nbytes() for w in linears)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    linear_params = sum(w.numel() for w in linears)
    print(
        json.dumps(
            dict(
                mode=mode,
                load_peak_rss_mb=(peak - before) / 1024,
                kept_packed_mb=packed / 2**20,
                other_dense_mb=dense / 2**20,
                linear_params=linear_params,
                linears_float32_mb=linear_params * 4 / 2**20,
            )
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return
    from tests.engine.test_gguf import write_gguf

    name = f"conveyor-bench-llama-{args.hidden}x{args.layers}"
    path = bench_model(
        name,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=16,
        num_kv_heads=8,
        intermediate_size=args.hidden * 11 // 4,
        vocab_size=512,
    )
    file = path.parent / f"{name}-gguf" / "model.gguf"
    if not file.exists():
        write_gguf(str(path), file.parent, "Q8_0")
    env = dict(os.environ, TRITON_INTERPRET="1")
    results: dict = {"model": name, "file_mb": file.stat().st_size / 2**20, "runs": []}
    for mode in ("dense-first", "per-tensor"):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_load_memory", "--child", str(file), mode],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        run = json.loads(out.stdout.strip().splitlines()[-1])
        results["runs"].append(run)
        print(
            f"{mode:12s} peak RSS while loading {run['load_peak_rss_mb']:8.1f} MB; "
            f"holds {run['kept_packed_mb']:.1f} MB of Q8_0 blocks "
            f"for {run['linears_float32_mb']:.1f} MB of float32 linear weights, "
            f"{run['other_dense_mb']:.1f} MB else"
        )
    write_results("load_memory.json", results)


if __name__ == "__main__":
    main()
