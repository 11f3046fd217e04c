"""Shared prefix: many requests behind one long system prompt, prefix caching on vs off.

200 requests share a 1,000-token system prompt, each followed by its own 10-30-token
question, 16 tokens out each, all submitted at once. The same workload runs on two fresh
engines, caching on and off, side by side in one process; we report the prompt tokens each
had to compute, the wall time and throughput, and the ratios. Writes JSON to
benchmarks/results/prefix_cache.json.

    python -m benchmarks.bench_prefix_cache [--requests 200] [--system-tokens 1000]
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import bench_model, write_results
from conveyor.engine import LLM, SamplingParams


def run(path, prompts, caching: bool, policy: str) -> dict:
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=caching, scheduling_policy=policy)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    stats = llm.engine.stats()
    prompt_tokens = sum(len(p) for p in prompts)
    generated = sum(len(o.token_ids) for o in outs)
    return {
        "prefix_caching": caching,
        "policy": policy,
        "seconds": elapsed,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": stats.num_prompt_tokens_computed,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "generated_tokens": generated,
        "requests_per_s": len(prompts) / elapsed,
        "tokens_per_s": (prompt_tokens + generated) / elapsed,
        "token_ids": [o.token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n, system_len = (20, 200) if args.quick else (args.requests, args.system_tokens)

    path = bench_model()
    rng = random.Random(0)
    system = [rng.randrange(5, 500) for _ in range(system_len)]
    prompts = [system + [rng.randrange(5, 500) for _ in range(rng.randint(10, 30))] for _ in range(n)]

    off = run(path, prompts, caching=False, policy="fcfs")
    on = run(path, prompts, caching=True, policy="fcfs")
    assert on.pop("token_ids") == off.pop("token_ids"), "prefix caching changed the outputs"
    res = {
        "workload": {
            "requests": n,
            "system_prompt_tokens": system_len,
            "question_tokens": "10-30",
            "output_tokens": 16,
        },
        "off": off,
        "on": on,
        "prefill_tokens_saved": 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"],
        "throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"],
    }
    print(f"\n{n} requests sharing a {system_len}-token system prompt, 16 tokens out each:")
    print(
        f"  prompt tokens computed: off {off['prompt_tokens_computed']:8d}  on {on['prompt_tokens_computed']:8d}"
        f"   ({res['prefill_tokens_saved']:.1%} fewer)"
    )
    print(f"  wall time:              off {off['seconds']:8.2f}s on {on['seconds']:8.2f}s")
    print(
        f"  throughput (tok/s):     off {off['tokens_per_s']:8.0f}  on {on['tokens_per_s']:8.0f}"
        f"   ({res['throughput_ratio']:.1f}x)"
    )
    write_results("prefix_cache.json", res)


if __name__ == "__main__":
    main()
