"""KV-cache memory: waste and concurrency, paged (ours) against contiguous reservation.

One engine run over a mixed-length workload (prompts of 64-1024 tokens, outputs of 10-500)
with a fixed KV cache and a high sequence cap, so memory is what limits the batch. After
every step we record, for the requests holding KV:

- paged: slots allocated (their blocks x block_size) and slots holding a token;
- contiguous: what reserving ``max_model_len`` slots per request (the usual contiguous
  buffer) would allocate for the same requests, and what reserving exactly
  ``prompt + max_tokens`` (a contiguous allocator told each request's maximum) would.

Waste = allocated-but-unused slots / allocated slots, over the whole run. Concurrency = the
most requests that held KV at once, against how many contiguous reservations fit in the
same memory. Writes JSON and a PNG plot to benchmarks/results/.

Then the KV cache's dtype: the same workload in bf16 on one memory budget (what
``--kv-tokens`` bf16 tokens take), with ``kv_cache_dtype="auto"`` (bf16 K/V) and ``"fp8"``
(e4m3): KV tokens the budget holds and the peak of requests holding KV at once.

    python benchmarks/bench_kv_memory.py [--requests 400] [--kv-tokens 65536]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.common import RESULTS, bench_model, write_results
from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from conveyor.engine.config import kv_block_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--kv-tokens", type=int, default=65536, help="KV cache capacity in tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n = 40 if args.quick else args.requests
    kv_tokens = 8192 if args.quick else args.kv_tokens

    path = bench_model(
        "conveyor-bench-llama-small", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    bs = args.block_size
    common = dict(block_size=bs, max_num_seqs=1024, max_model_len=args.max_model_len, enable_prefix_caching=False)
    engine = LLMEngine(EngineConfig(str(path), dtype="float32", num_kv_blocks=kv_tokens // bs, **common))
    reserve_exact = _add_workload(engine, n)
    totals, trace, peak_running, elapsed = _run(engine, reserve_exact, bs, args.max_model_len)

    def waste(alloc_key: str) -> float:
        return 1 - totals["used"] / totals[alloc_key]

    fit_max = kv_tokens // args.max_model_len
    mean_exact = sum(reserve_exact.values()) / n
    fit_exact = int(kv_tokens // mean_exact)
    res = {
        "workload": {
            "requests": n,
            "prompt_tokens": "64-1024",
            "output_tokens": "10-500",
            "kv_cache_tokens": kv_tokens,
            "block_size": bs,
            "max_model_len": args.max_model_len,
        },
        "waste_paged": waste("paged_alloc"),
        "waste_contiguous_max_len": waste("contig_max_alloc"),
        "waste_contiguous_exact_reservation": waste("contig_exact_alloc"),
        "peak_concurrent_paged": peak_running,
        "concurrent_contiguous_max_len": fit_max,
        "concurrent_contiguous_exact_reservation_mean": fit_exact,
        "concurrency_ratio_vs_max_len": peak_running / fit_max,
        "concurrency_ratio_vs_exact_reservation": peak_running / fit_exact,
        "preemptions": engine.stats().num_preemptions,
        "steps": len(trace),
        "seconds": elapsed,
    }
    print(f"\nKV waste (allocated-but-unused / allocated), {n} mixed requests, block {bs}:")
    print(f"  paged (ours)                         {res['waste_paged']:7.2%}")
    print(f"  contiguous, max_model_len reserved   {res['waste_contiguous_max_len']:7.2%}")
    print(f"  contiguous, prompt+max_tokens        {res['waste_contiguous_exact_reservation']:7.2%}")
    print(f"concurrency in {kv_tokens} KV tokens:")
    print(f"  paged (ours), peak                   {peak_running:7d}")
    ratio_max, ratio_exact = res["concurrency_ratio_vs_max_len"], res["concurrency_ratio_vs_exact_reservation"]
    print(f"  contiguous, max_model_len reserved   {fit_max:7d}   ratio {ratio_max:.1f}x")
    print(f"  contiguous, prompt+max_tokens (mean) {fit_exact:7d}   ratio {ratio_exact:.1f}x")
    res["kv_cache_dtype"] = _compare_kv_dtypes(path, n, kv_tokens, common)
    write_results("kv_memory.json", res)
    _plot(trace, args.max_model_len, kv_tokens)


def _add_workload(engine: LLMEngine, n: int) -> dict[str, int]:
    """The mixed-length requests; each one's prompt + max_tokens by id."""
    rng = random.Random(0)
    vocab = engine.vocab_size
    reserve_exact = {}
    for i in range(n):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(64, 1024))]
        max_tokens = rng.randint(10, 500)
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        reserve_exact[f"r{i}"] = len(prompt) + max_tokens
    return reserve_exact


def _run(engine: LLMEngine, reserve_exact: dict[str, int], bs: int, max_model_len: int):
    """Step to the end: the summed slot counts, the per-step trace, the peak of KV holders, seconds."""
    totals = {"paged_alloc": 0, "used": 0, "contig_max_alloc": 0, "contig_exact_alloc": 0}
    trace = []
    peak_running = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        holders = [r for r in engine.scheduler.running if engine.kv.block_ids(r.seq_id)]
        used = sum(r.num_computed_tokens for r in holders)
        paged = bs * sum(len(engine.kv.block_ids(r.seq_id)) for r in holders)
        totals["used"] += used
        totals["paged_alloc"] += paged
        totals["contig_max_alloc"] += max_model_len * len(holders)
        totals["contig_exact_alloc"] += sum(reserve_exact[r.request_id] for r in holders)
        peak_running = max(peak_running, len(holders))
        trace.append((used, paged, len(holders)))
    return totals, trace, peak_running, time.perf_counter() - t0


def _compare_kv_dtypes(path, n: int, kv_tokens: int, common: dict) -> dict:
    """bf16 K/V against FP8 K/V in one memory budget (``kv_tokens`` bf16 tokens): the tokens
    each holds and the peak of requests holding KV at once on the workload."""
    spec = LLMEngine(EngineConfig(str(path), dtype="bfloat16", num_kv_blocks=1, **common)).runner.model_spec
    budget = kv_block_bytes(spec.num_layers, kv_tokens, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    out: dict = {"kv_cache_memory_bytes": budget, "model_dtype": "bfloat16"}
    print(f"\nKV cache dtype, {budget / 2**20:.1f} MiB of KV, {n} mixed requests (bf16 model):")
    for kv_dtype in ("auto", "fp8"):
        engine = LLMEngine(
            EngineConfig(str(path), dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype=kv_dtype, **common)
        )
        tokens = engine.runner.num_blocks * common["block_size"]
        _, _, peak, seconds = _run(engine, _add_workload(engine, n), common["block_size"], common["max_model_len"])
        name = "bf16" if kv_dtype == "auto" else "fp8"
        out[name] = {"kv_tokens": tokens, "peak_concurrent": peak, "preemptions": engine.stats().num_preemptions}
        print(f"  {name:5s} KV tokens {tokens:8d}   peak concurrent requests {peak:5d}   ({seconds:.0f} s)")
    out["kv_tokens_ratio"] = out["fp8"]["kv_tokens"] / out["bf16"]["kv_tokens"]
    out["concurrency_ratio"] = out["fp8"]["peak_concurrent"] / out["bf16"]["peak_concurrent"]
    print(f"  fp8 / bf16: {out['kv_tokens_ratio']:.2f}x the tokens, {out['concurrency_ratio']:.2f}x the concurrency")
    return out


def _plot(trace, max_len: int, kv_tokens: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    steps = range(len(trace))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, [t[1] for t in trace], label="paged: allocated slots")
    ax.plot(steps, [t[0] for t in trace], label="tokens held", linestyle="--")
    ax.plot(steps, [t[2] * max_len for t in trace], label="contiguous max_model_len reservation for the same requests")
    ax.axhline(kv_tokens, color="gray", linewidth=0.8, label="KV cache capacity")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV token slots")
    ax.set_title("KV memory: paged allocation vs contiguous reservation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = RESULTS / "kv_memory.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
