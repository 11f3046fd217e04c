"""Decode throughput with and without CUDA graphs, side by side in one process (GPU only).

For each batch size, that many requests (32 random prompt tokens, 128 tokens out, EOS
ignored) run to completion on two engines over the same random-weight model, one capturing
its decode batches as CUDA graphs and one with ``enforce_eager=True``; the runs alternate
so both see the same machine. Decode dominates: 127 of the 128 steps are decode-only.

    python -m benchmarks.bench_cuda_graphs                      # batches 1 8 64 256, bf16
    python -m benchmarks.bench_cuda_graphs --batches 1 16 --layers 8

Model: Llama-like, hidden 2048, 16 layers, 32 query / 8 KV heads of 64 (about 1B
parameters with this vocabulary). Writes benchmarks/results/cuda_graphs_<gpu>.json. Needs a
CUDA GPU; elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import bench_model, gpu_tag, write_results
from engine import LLM, SamplingParams
from kernels.utils import cdiv

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 128


def _run(llm: LLM, batch: int, seed: int) -> float:
    """Generated tokens per second for ``batch`` requests decoded together."""
    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == batch * OUTPUT_TOKENS
    return batch * OUTPUT_TOKENS / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per engine and batch; best kept")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda_graphs needs a CUDA GPU; none here")
        return 0

    model = bench_model(
        f"conveyor-bench-graphs-{args.layers}",
        hidden_size=2048,
        num_layers=args.layers,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=8192,
        max_position_embeddings=4096,
    )
    max_batch = max(args.batches)
    blocks = max_batch * cdiv(PROMPT_TOKENS + OUTPUT_TOKENS, 16) + 64
    common = dict(
        dtype="bfloat16", max_num_seqs=max_batch, num_kv_blocks=blocks, max_model_len=2048, enable_prefix_caching=False
    )
    engines = {
        "graphs": LLM(str(model), cuda_graph_max_batch_size=max_batch, **common),
        "eager": LLM(str(model), enforce_eager=True, **common),
    }
    assert engines["graphs"].engine.runner.graphs is not None
    for llm in engines.values():
        _run(llm, 4, seed=99)  # warm-up: kernels compiled, allocator settled

    rows = []
    for batch in args.batches:
        best = {name: 0.0 for name in engines}
        for r in range(args.repeats):
            for name, llm in engines.items():
                best[name] = max(best[name], _run(llm, batch, seed=r))
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
            f"{best['graphs'] / best['eager']:5.2f}x"
        )

    gpu = torch.cuda.get_device_name(0)
    write_results(
        f"cuda_graphs_{gpu_tag()}.json",
        {
            "gpu": gpu,
            "model": {"hidden": 2048, "layers": args.layers, "heads": "32/8", "dtype": "bfloat16"},
            "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
