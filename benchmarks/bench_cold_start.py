"""Cold start: how long a fresh process takes to import the engine and build it, by phase.

For each model size, ``--repeat`` fresh Python processes one after the other (what ``conveyor
bench --cold-start`` runs), each building the engine exactly as a worker does (its
``EngineConfig``, ``CONVEYOR_ENGINE_ARGS`` applied): ``import`` (process start, from the
kernel's record, to the engine beginning to load), ``weights`` (config, tokenizer, weights;
the tokenizer's part said apart), ``kv_cache``, ``cuda_graphs`` (GPU only), ``other``, and
the ``total``. The first run may pay for a cold page cache; the median is over all runs.
Writes benchmarks/results/cold_start.json.

    python -m benchmarks.bench_cold_start [--sizes tiny,small] [--repeat 5]
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.bench_continuous_batching import SIZES
from benchmarks.common import bench_model, write_results
from conveyor.testing.bench import format_cold_start, run_cold_start
from conveyor.worker.core.settings import Settings
from conveyor.worker.execution.context import engine_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,small", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="one run of the tiny model, to check the script works")
    args = ap.parse_args()
    sizes = ["tiny"] if args.quick else args.sizes.split(",")
    repeat = 1 if args.quick else args.repeat

    results: dict[str, Any] = {"repeat": repeat, "sizes": {}}
    for size in sizes:
        spec = dict(SIZES[size])
        model_dir = bench_model(**spec)
        config = engine_config(Settings(), str(model_dir)).as_flat()
        model = config.pop("model")
        result = run_cold_start(model, engine_args=config, repeat=repeat)
        print(f"[{size}] " + format_cold_start(result))
        weights_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        results["sizes"][size] = {**result.as_dict(), "checkpoint": {**spec, "weights_bytes": weights_bytes}}
    if not args.quick:
        write_results("cold_start.json", results)


if __name__ == "__main__":
    main()
