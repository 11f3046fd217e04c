"""The online prefill chunk budget: decode latency while long prompts arrive, with and without
an inter-token latency target, in one run.

``bench_scheduling`` runs a tiny model, whose step time is mostly fixed overhead: a longer
prefill chunk hardly slows a step there, so a latency target has nothing to act on. Here the
model is large enough (hidden 512, 8 layers) that a step's time grows with its tokens on a
CPU, as it does on a GPU with a real model.

The workload: ``--decoders`` requests with short prompts decode ``--decode-tokens`` tokens
each from the start; ``--long-prompts`` prompts of ``--long-prompt-tokens`` tokens arrive one
every ``ARRIVAL_EVERY_STEPS`` steps while they decode. Configurations, each on the same
arrivals:

- ``one chunk``: ``max_num_batched_tokens`` fits a whole long prompt, no target: a prompt's
  prefill runs in one step, and every decoding request waits for it;
- ``small chunks``: a fixed small ``max_num_batched_tokens`` (``SMALL_BUDGET``), no target:
  the usual static cure, which also slows every prefill;
- ``target``: the large ``max_num_batched_tokens`` with ``target_itl_ms`` set to
  ``--target-factor`` times the inter-token latency p50 of a warm-up run of ``one chunk``
  (most of its steps carry decodes alone): the engine finds the chunk size itself.

Reported for each: the decoders' inter-token latency (per request, between consecutive
tokens, in ms) p50/p90/p99 and max; the long prompts' time to first token (mean, max); the
run's wall time and output tokens per second; the final prefill budget. The configurations
alternate ``--repeat`` times and each one's fastest run counts (a busy machine's noise only
slows a run down). Prints a table, writes benchmarks/results/chunk_budget[_<gpu>].json and a
PNG beside it.

    python -m benchmarks.bench_chunk_budget [--decoders 8] [--long-prompts 12] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import RESULTS, bench_model, gpu_tag, write_results
from conveyor.engine import EngineConfig, LLMEngine, SamplingParams

SIZES: dict[str, int] = dict(
    hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536, max_position_embeddings=4096
)
BLOCK_SIZE = 16
LARGE_BUDGET = 2048
SMALL_BUDGET = 128
ARRIVAL_EVERY_STEPS = 24
FIRST_ARRIVAL_STEP = 16


@dataclass
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams


def workload(decoders: int, decode_tokens: int, long_prompts: int, long_tokens: int, vocab: int) -> list[Arrival]:
    rng = random.Random(0)

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    arrivals = [
        Arrival(0, f"decode-{i}", [rng.randrange(5, vocab) for _ in range(32)], greedy(decode_tokens))
        for i in range(decoders)
    ]
    for i in range(long_prompts):
        prompt = [rng.randrange(5, vocab) for _ in range(long_tokens)]
        step = FIRST_ARRIVAL_STEP + i * ARRIVAL_EVERY_STEPS
        arrivals.append(Arrival(step, f"long-{i}", prompt, greedy(4)))
    return sorted(arrivals, key=lambda a: a.step)


def make_engine(model: str, budget: int, target_itl_ms: float | None, num_kv_blocks: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model,
            dtype="float32",
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=64,
            max_num_batched_tokens=budget,
            target_itl_ms=target_itl_ms,
            enable_prefix_caching=False,
        )
    )


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(model: str, arrivals: list[Arrival], budget: int, target_itl_ms: float | None, num_kv_blocks: int) -> dict:
    engine = make_engine(model, budget, target_itl_ms, num_kv_blocks)
    pending = list(arrivals)
    added_at: dict[str, float] = {}
    first_token_at: dict[str, float] = {}
    last_token_at: dict[str, tuple[int, float]] = {}  # request -> (tokens so far, when the last came)
    itl: list[float] = []
    tokens: dict[str, list[int]] = {}
    step = 0
    begin = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.request_id, a.prompt, a.params)
            added_at[a.request_id] = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = len(out.token_ids)
            if n and out.request_id not in first_token_at:
                first_token_at[out.request_id] = now
            seen, when = last_token_at.get(out.request_id, (0, 0.0))
            if n > seen:
                if seen and out.request_id.startswith("decode-"):
                    itl.append(now - when)
                last_token_at[out.request_id] = (n, now)
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
        step += 1
    wall = time.perf_counter() - begin
    assert len(tokens) == len(arrivals)
    ttft = [first_token_at[rid] - added_at[rid] for rid in added_at if rid.startswith("long-")]
    chunks = engine.scheduler.chunk_controller
    output_tokens = sum(len(t) for t in tokens.values())
    return {
        "max_num_batched_tokens": budget,
        "target_itl_ms": target_itl_ms,
        "itl_p50_ms": 1000 * pct(itl, 0.5),
        "itl_p90_ms": 1000 * pct(itl, 0.9),
        "itl_p99_ms": 1000 * pct(itl, 0.99),
        "itl_max_ms": 1000 * max(itl),
        "long_prompt_ttft_mean_s": statistics.mean(ttft),
        "long_prompt_ttft_max_s": max(ttft),
        "wall_s": wall,
        "output_tokens_per_s": output_tokens / wall,
        "steps": step,
        "final_prefill_budget": chunks.budget if chunks is not None else None,
        "budget_shrinks": chunks.num_shrinks if chunks is not None else None,
        "budget_grows": chunks.num_grows if chunks is not None else None,
        "token_ids": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=320)
    ap.add_argument("--long-prompts", type=int, default=12)
    ap.add_argument("--long-prompt-tokens", type=int, default=1536)
    ap.add_argument("--target-factor", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = str(bench_model("conveyor-bench-llama-512x8", **SIZES))
    arrivals = workload(args.decoders, args.decode_tokens, args.long_prompts, args.long_prompt_tokens, vocab=512)
    per_request = -(-(args.long_prompt_tokens + args.decode_tokens + 8) // BLOCK_SIZE)
    num_kv_blocks = per_request * (args.decoders + args.long_prompts) + 16  # room for all: no preemption

    # The target is set from this workload's own decode steps: a warm-up run in one chunk,
    # whose inter-token latency p50 is a step with every request decoding and no prefill.
    warm = run(model, arrivals, LARGE_BUDGET, None, num_kv_blocks)
    floor_ms = warm["itl_p50_ms"]
    target_itl_ms = round(args.target_factor * floor_ms, 1)
    print(f"warm-up: ITL p50 {floor_ms:.1f} ms with no prefill in the step -> target_itl_ms {target_itl_ms}")
    configs: dict[str, tuple[int, float | None]] = {
        "one chunk": (LARGE_BUDGET, None),
        "small chunks": (SMALL_BUDGET, None),
        "target": (LARGE_BUDGET, target_itl_ms),
    }
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for rep in range(args.repeat):
        for name, (budget, target) in configs.items():
            runs[name].append(run(model, arrivals, budget, target, num_kv_blocks))
            print(f"  round {rep + 1}: {name} in {runs[name][-1]['wall_s']:.1f} s")
    results = {name: min(rs, key=lambda r: r["wall_s"]) for name, rs in runs.items()}
    reference = results["one chunk"].pop("token_ids")
    for name in ("small chunks", "target"):
        assert results[name].pop("token_ids") == reference, f"{name}: outputs differ from one chunk's"

    cols = [
        ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
        ("itl_p90_ms", "ITL p90 ms", "{:.1f}"),
        ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
        ("itl_max_ms", "ITL max ms", "{:.0f}"),
        ("long_prompt_ttft_mean_s", "long TTFT s", "{:.2f}"),
        ("wall_s", "wall s", "{:.1f}"),
        ("output_tokens_per_s", "out tok/s", "{:.0f}"),
        ("final_prefill_budget", "final budget", "{}"),
    ]
    print(f"\ntarget_itl_ms {target_itl_ms} ({args.target_factor}x the warm-up's ITL p50)")
    print(f"{'config':<14}" + "".join(f"{label:>14}" for _, label, _ in cols))
    for name, r in results.items():
        print(f"{name:<14}" + "".join(f"{fmt.format(r[key]):>14}" for key, _, fmt in cols))
    tag = f"_{gpu_tag()}" if torch.cuda.is_available() else ""
    write_results(
        f"chunk_budget{tag}.json",
        {
            "workload": {
                "model": SIZES,
                "decoders": args.decoders,
                "decode_tokens": args.decode_tokens,
                "long_prompts": args.long_prompts,
                "long_prompt_tokens": args.long_prompt_tokens,
                "arrival_every_steps": ARRIVAL_EVERY_STEPS,
                "warmup_itl_p50_ms": floor_ms,
                "target_itl_ms": target_itl_ms,
                "repeat": args.repeat,
                "threads": args.threads,
            },
            "results": results,
        },
    )
    _plot(results, target_itl_ms, tag)


def _plot(results: dict[str, dict[str, Any]], target_itl_ms: float, tag: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    names = list(results)
    fig, (lat, ttft, thr) = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.25
    for i, (key, label) in enumerate((("itl_p50_ms", "p50"), ("itl_p90_ms", "p90"), ("itl_p99_ms", "p99"))):
        lat.bar([x + (i - 1) * width for x in range(len(names))], [results[n][key] for n in names], width, label=label)
    lat.axhline(target_itl_ms, color="red", linestyle="--", linewidth=1, label="target")
    lat.set_xticks(range(len(names)), names)
    lat.set_title("decoders' inter-token latency (ms)", fontsize=10)
    lat.legend(fontsize=8)
    ttft.bar(names, [results[n]["long_prompt_ttft_mean_s"] for n in names], color="#8fa8c8")
    ttft.set_title("long prompts' mean time to first token (s)", fontsize=10)
    thr.bar(names, [results[n]["output_tokens_per_s"] for n in names], color="#8fa8c8")
    thr.set_title("output tokens / s", fontsize=10)
    fig.suptitle("Prefill chunk budget: one chunk, fixed small chunks, or adapted to a latency target")
    fig.tight_layout()
    out = RESULTS / f"chunk_budget{tag}.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
