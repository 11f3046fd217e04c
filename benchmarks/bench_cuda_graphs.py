"""Decode throughput with and without CUDA graphs, side by side in one process (GPU only).

For each batch size, that many requests (32 random prompt tokens, 128 tokens out, EOS
ignored) run to completion on two engines over the same random-weight model, one capturing
its decode batches as CUDA graphs and one with ``enforce_eager=True``; the runs alternate
so both see the same machine. Decode dominates: 127 of the 128 steps are decode-only.

    python -m benchmarks.bench_cuda_graphs                      # batches 1 8 64 256, bf16
    python -m benchmarks.bench_cuda_graphs --batches 1 16 --layers 8

Model: Llama-like, hidden 2048, 16 layers, 32 query / 8 KV heads of 64 (about 1B
parameters with this vocabulary). Writes benchmarks/results/cuda_graphs_<gpu>.json (or
``--out``). Without a GPU it says so and exits 0; ``--dry-run`` then runs the same code on a
tiny model in Triton's interpreter, the graphs replaced by ``CallingGraph``.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from benchmarks.common import bench_model, gpu_tag, interpret_kernels_without_gpu, write_results
from conveyor.engine import LLM, SamplingParams
from conveyor.kernels.utils import cdiv

PROMPT_TOKENS = 32


def _run(llm: LLM, batch: int, seed: int, output_tokens: int) -> float:
    """Generated tokens per second for ``batch`` requests decoded together."""
    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    _sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync()
    elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == batch * output_tokens
    return batch * output_tokens / elapsed


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 8 64 256 (dry run: 1 4)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=None, help="default 128 (dry run: 6)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per engine and batch; best kept")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default results/cuda_graphs_<gpu>.json)")
    ap.add_argument("--dry-run", action="store_true", help="without a GPU: a tiny model, graphs replayed by calling")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.dry_run:
        print("bench_cuda_graphs needs a CUDA GPU; none here (--dry-run checks the script on CPU)")
        return 0
    interpret_kernels_without_gpu()
    dry = args.dry_run and not on_gpu
    batches = args.batches or ([1, 4] if dry else [1, 8, 64, 256])
    output_tokens = args.output_tokens or (6 if dry else 128)
    repeats = 1 if dry else args.repeats

    if dry:
        model = bench_model("conveyor-bench-graphs-dry", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
        dims = {"hidden": 64, "layers": 2, "heads": "4/2", "dtype": "float32"}
    else:
        model = bench_model(
            f"conveyor-bench-graphs-{args.layers}",
            hidden_size=2048,
            num_layers=args.layers,
            num_heads=32,
            num_kv_heads=8,
            intermediate_size=8192,
            max_position_embeddings=4096,
        )
        dims = {"hidden": 2048, "layers": args.layers, "heads": "32/8", "dtype": "bfloat16"}
    max_batch = max(batches)
    blocks = max_batch * cdiv(PROMPT_TOKENS + output_tokens, 16) + 64
    common = dict(
        dtype=dims["dtype"],
        device="cuda" if on_gpu else "cpu",
        attention_backend="triton",
        max_num_seqs=max_batch,
        num_kv_blocks=blocks,
        max_model_len=2048,
        enable_prefix_caching=False,
    )
    engines = {
        "graphs": LLM(str(model), cuda_graph_max_batch_size=max_batch, enforce_eager=dry, **common),
        "eager": LLM(str(model), enforce_eager=True, **common),
    }
    if dry:
        from conveyor.engine.runner.cuda_graphs import CallingGraph

        engines["graphs"].engine.runner.capture_decode_graphs(graph_factory=CallingGraph)
    assert engines["graphs"].engine.runner.graphs is not None
    for llm in engines.values():
        _run(llm, min(4, max_batch), seed=99, output_tokens=output_tokens)  # warm-up: kernels compiled

    rows = []
    for batch in batches:
        best = {name: 0.0 for name in engines}
        for r in range(repeats):
            for name, llm in engines.items():
                best[name] = max(best[name], _run(llm, batch, seed=r, output_tokens=output_tokens))
        rows.append(
            {
                "batch": batch,
                "graphs_tok_s": best["graphs"],
                "eager_tok_s": best["eager"],
                "speedup": best["graphs"] / best["eager"],
            }
        )
        print(
            f"batch {batch:4d}: graphs {best['graphs']:10.0f} tok/s   eager {best['eager']:10.0f} tok/s   "
            f"{best['graphs'] / best['eager']:5.2f}x",
            flush=True,
        )
    replays = dict(engines["graphs"].engine.runner.graphs.replays)
    assert replays, "the graph engine never replayed a graph"
    gpu = torch.cuda.get_device_name(0) if on_gpu else "cpu (dry run)"
    write_results(
        args.out or f"cuda_graphs_{gpu_tag() if on_gpu else 'cpu'}.json",
        {
            "gpu": gpu,
            "model": dims,
            "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": output_tokens,
            "rows": rows,
            "graph_replays_by_bucket": replays,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
