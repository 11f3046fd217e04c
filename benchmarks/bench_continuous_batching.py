"""Continuous batching throughput: our engine against transformers on the same small model.

Two workloads, run side by side in one process so the ratios are fair on a noisy machine:

1. mixed: output lengths drawn uniformly from 10 to 500 tokens (the seed articles'
   restaurant example), prompts of 8-64 tokens. Our engine vs transformers' static batched
   ``generate`` (batches of 8 in arrival order, left-padded, each batch run to its longest
   request). Throughput counts only the tokens each request asked for.
2. uniform: every request 128 tokens out. Our engine vs transformers' own continuous
   batching (``generate_batch``), where it exists.

Prints a table and writes JSON (with machine info) to benchmarks/results/.

    python -m benchmarks.bench_continuous_batching [--size small|medium] [--requests 64] [--quick]

Model sizes: ``tiny`` (the tests' shape: hidden 64, 2 layers, 4 heads / 2 KV heads; per-step
host overhead decides), ``small`` (hidden 128, 4 layers, 4 / 2 heads) and ``medium`` (hidden
256, 4 layers, 8 / 4 heads). The larger the model, the more a CPU run is bound by reading
each request's KV every step, which continuous batching does not reduce: the pure-torch
paged path must gather the blocks into a padded batch before its matmuls, while static
batching pays a similar copy for its concatenated cache.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from benchmarks.common import bench_model, write_results
from conveyor.engine import LLM, SamplingParams


def workload(n: int, seed: int, out_lo: int, out_hi: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(8, 64))] for _ in range(n)]
    return prompts, [rng.randint(out_lo, out_hi) for _ in range(n)]


def run_engine(llm: LLM, prompts, lengths) -> dict:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(lengths), "engine produced a different number of tokens than asked"
    return {"seconds": dt, "tokens": produced, "tokens_per_s": produced / dt}


def _no_eos_config(model, max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.generation_config.pad_token_id,
        bos_token_id=None,
    )


@torch.inference_mode()
def run_hf_static(model, prompts, lengths, batch_size: int = 8) -> dict:
    pad = model.generation_config.pad_token_id
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch_size):
        batch, want = prompts[i : i + batch_size], lengths[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(ids, attention_mask=mask, generation_config=_no_eos_config(model, max(want)))
        assert out.shape[1] - width == max(want)
        useful += sum(want)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "tokens": useful, "tokens_per_s": useful / dt}


def run_hf_generate_batch(model, prompts, lengths) -> dict | None:
    if not hasattr(model, "generate_batch"):
        return None
    config = _no_eos_config(model, lengths[0])
    t0 = time.perf_counter()
    outs = model.generate_batch(prompts, generation_config=config)
    dt = time.perf_counter() - t0
    produced = sum(len(o.generated_tokens) for o in outs.values())
    if produced != sum(lengths):
        raise RuntimeError(f"generate_batch produced {produced} tokens, {sum(lengths)} asked")
    return {"seconds": dt, "tokens": produced, "tokens_per_s": produced / dt}


SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        name="conveyor-bench-llama-64", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
    ),
    "small": dict(
        name="conveyor-bench-llama-128",
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
    ),
    "medium": dict(
        name="conveyor-bench-llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--uniform-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="a small run to check the script works")
    args = ap.parse_args()
    n = 16 if args.quick else args.requests
    hi = 60 if args.quick else 500
    uniform = 16 if args.quick else args.uniform_tokens

    model_dir = bench_model(**SIZES[args.size])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32")
    vocab = hf.config.vocab_size

    warm_p, warm_l = workload(8, 99, 4, 8, vocab)
    run_engine(llm, warm_p, warm_l)
    run_hf_static(hf, warm_p, warm_l)

    mixed_p, mixed_l = workload(n, 0, 10, hi, vocab)
    res: dict[str, Any] = {"workload_mixed": {"requests": n, "output_tokens": f"10-{hi}", "prompt_tokens": "8-64"}}
    res["engine_mixed"] = run_engine(llm, mixed_p, mixed_l)
    res["hf_static_mixed"] = run_hf_static(hf, mixed_p, mixed_l)
    uni_p, _ = workload(n, 1, 1, 1, vocab)
    uni_l = [uniform] * n
    res["workload_uniform"] = {"requests": n, "output_tokens": uniform}
    res["engine_uniform"] = run_engine(llm, uni_p, uni_l)
    res["hf_generate_batch_uniform"] = run_hf_generate_batch(hf, uni_p, uni_l)

    res["ratio_vs_static"] = res["engine_mixed"]["tokens_per_s"] / res["hf_static_mixed"]["tokens_per_s"]
    if res["hf_generate_batch_uniform"]:
        res["ratio_vs_generate_batch"] = (
            res["engine_uniform"]["tokens_per_s"] / res["hf_generate_batch_uniform"]["tokens_per_s"]
        )
    res["engine_stats"] = vars(llm.engine.stats())
    res["model"] = {
        "family": "llama",
        "hidden": hf.config.hidden_size,
        "layers": hf.config.num_hidden_layers,
        "params": sum(p.numel() for p in hf.parameters()),
    }

    print(f"\nmixed workload: {n} requests, outputs 10-{hi} tokens")
    print(f"  conveyor engine          {res['engine_mixed']['tokens_per_s']:9.0f} tok/s")
    print(f"  transformers static (8)  {res['hf_static_mixed']['tokens_per_s']:9.0f} tok/s")
    print(f"  ratio                    {res['ratio_vs_static']:9.2f}x")
    print(f"uniform workload: {n} requests x {uniform} tokens")
    print(f"  conveyor engine          {res['engine_uniform']['tokens_per_s']:9.0f} tok/s")
    if res["hf_generate_batch_uniform"]:
        print(f"  transformers generate_batch {res['hf_generate_batch_uniform']['tokens_per_s']:6.0f} tok/s")
        print(f"  ratio                    {res['ratio_vs_generate_batch']:9.2f}x")
    res["model"]["size"] = args.size
    write_results(f"continuous_batching_{args.size}_{n}.json", res)


if __name__ == "__main__":
    main()
