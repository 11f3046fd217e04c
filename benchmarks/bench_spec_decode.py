"""Speculative decoding: output tokens per second with and without it, and acceptance rates.

Two workloads, each on two engines, without speculation and with it, in one process, greedy,
the outputs checked identical; the two alternate ``--repeat`` times and the fastest run of
each counts (a busy machine's noise only ever slows a run down):

- ``ngram`` (prompt lookup): a copy-heavy workload. Random weights do not copy from a prompt,
  so the target is a random Llama with small weights, which falls into loops and repeated
  phrases (as a real model's extraction or rewriting output repeats its input); the prompts
  are random sequences repeated a few times.
- ``draft``: the same-sized target with its upper layers' output projections scaled down,
  and as draft its first layers alone (same tokenizer, a fraction of the compute): a draft
  that agrees with the target often but not always, as a small model of the same family does.

We report output tok/s, the speed-up, acceptance rate (overall and per proposal position)
and mean tokens per verification step. Writes benchmarks/results/spec_decode[_<gpu>].json and
a PNG beside it.

    python -m benchmarks.bench_spec_decode [--requests 8] [--output-tokens 128] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, gpu_tag, write_results
from conveyor.engine import LLM, SamplingParams
from conveyor.testing.tiny_models import build_tiny_model, build_truncated_draft

SIZES: dict[str, Any] = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536)
DRAFT_LAYERS = 2
UPPER_SCALE = 0.05  # the target's layers above the draft's, scaled down: the draft agrees often


def models() -> tuple[Path, Path, Path]:
    """(the looping target for ngram, the draft workload's target, its draft), built once."""
    root = Path(tempfile.gettempdir())
    looping = root / "conveyor-bench-specdec-looping"
    if not (looping / "config.json").exists():
        build_tiny_model(looping, "llama", init_std=0.02, **SIZES)
    target, draft = root / "conveyor-bench-specdec-target", root / "conveyor-bench-specdec-draft"
    if not (draft / "config.json").exists():
        build_tiny_model(target, "llama", **SIZES)
        build_truncated_draft(target, draft, DRAFT_LAYERS, upper_scale=UPPER_SCALE)
    return looping, target, draft


def build(path: Path, spec: dict | None, dtype: str, prompts: list[list[int]]) -> LLM:
    llm = LLM(str(path), dtype=dtype, speculative_config=spec)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    return llm


def timed(llm: LLM, prompts: list[list[int]], output_tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps_before = llm.engine.stats().num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outs)
    return {
        "seconds": elapsed,
        "generated_tokens": generated,
        "output_tokens_per_s": generated / elapsed,
        "engine_steps": llm.engine.stats().num_steps - steps_before,
        "token_ids": [o.token_ids for o in outs],
    }


def compare(name: str, path: Path, prompts, output_tokens: int, spec: dict, dtype: str, repeat: int) -> dict[str, Any]:
    """Without and with speculation, alternating ``repeat`` times; the fastest run of each."""
    llms = {"off": build(path, None, dtype, prompts), "on": build(path, spec, dtype, prompts)}
    best: dict[str, dict[str, Any]] = {}
    for _ in range(repeat):
        for key, llm in llms.items():
            run = timed(llm, prompts, output_tokens)
            if key not in best or run["seconds"] < best[key]["seconds"]:
                best[key] = run
    off, on = best["off"], best["on"]
    on["speculative_config"] = spec
    s = llms["on"].engine.stats().spec_decode
    assert s is not None
    on.update(
        num_proposed_tokens=s.num_proposed_tokens,
        num_accepted_tokens=s.num_accepted_tokens,
        acceptance_rate=s.acceptance_rate,
        acceptance_rate_per_position=s.acceptance_rate_per_position,
        mean_accepted_per_verification=s.mean_accepted_per_verification,
    )
    same = on.pop("token_ids") == off.pop("token_ids")
    if dtype == "float32":
        assert same, f"{name}: speculative decoding changed the greedy outputs"
    speedup = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    print(
        f"  {name:6s} off {off['output_tokens_per_s']:8.0f} tok/s   on {on['output_tokens_per_s']:8.0f} tok/s   "
        f"speed-up {speedup:.2f}x   acceptance {on['acceptance_rate']:.1%} "
        f"(per position {', '.join(f'{a:.0%}' for a in on['acceptance_rate_per_position'])})   "
        f"steps {off['engine_steps']} -> {on['engine_steps']}"
    )
    return {"off": off, "on": on, "speedup": speedup, "outputs_identical": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="requests, all at once (default 8)")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    ap.add_argument("--dtype", default="float32", help="float32 (outputs checked identical) or bfloat16")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 is steadier on a busy machine)")
    ap.add_argument("--repeat", type=int, default=3, help="alternating runs; the fastest of each counts")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n, out_tokens = (4, 32) if args.quick else (args.requests, args.output_tokens)

    looping, target, draft = models()
    rng = random.Random(0)
    # Copy-heavy prompts: a random 24-token sequence said four times.
    copy_prompts = [[rng.randrange(5, 500) for _ in range(24)] * 4 for _ in range(n)]
    plain_prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(32, 96))] for _ in range(n)]
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    draft_spec = {"method": "draft", "model": str(draft), "num_speculative_tokens": args.k}
    print(f"\n{n} requests at once, {out_tokens} tokens out each, greedy, k={args.k}, {args.dtype}:")
    res: dict[str, Any] = {
        "workload": {
            "requests": n,
            "output_tokens": out_tokens,
            "num_speculative_tokens": args.k,
            "dtype": args.dtype,
            "repeat": args.repeat,
            "target": {**SIZES},
            "draft_layers": DRAFT_LAYERS,
            "draft_target_upper_layer_scale": UPPER_SCALE,
        },
        "ngram": compare("ngram", looping, copy_prompts, out_tokens, ngram, args.dtype, args.repeat),
        "draft": compare("draft", target, plain_prompts, out_tokens, draft_spec, args.dtype, args.repeat),
    }
    suffix = f"_{gpu_tag()}" if torch.cuda.is_available() else ""
    write_results(f"spec_decode{suffix}.json", res)
    _plot(res, RESULTS / f"spec_decode{suffix}.png")


def _plot(res: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["ngram", "draft"]
    x = range(len(names))
    off = [res[m]["off"]["output_tokens_per_s"] for m in names]
    on = [res[m]["on"]["output_tokens_per_s"] for m in names]
    left.bar([i - 0.2 for i in x], off, width=0.4, label="without")
    left.bar([i + 0.2 for i in x], on, width=0.4, label="with speculation")
    for i, m in enumerate(names):
        left.text(i + 0.2, on[i], f"{res[m]['speedup']:.2f}x", ha="center", va="bottom", fontsize=9)
    left.set_xticks(list(x), names)
    left.set_ylabel("output tokens / s")
    left.set_title("throughput")
    left.legend(fontsize=8)
    for m in names:
        rates = res[m]["on"]["acceptance_rate_per_position"]
        right.plot(range(1, len(rates) + 1), rates, marker="o", label=m)
    right.set_xticks(range(1, len(res["ngram"]["on"]["acceptance_rate_per_position"]) + 1))
    right.set_xlabel("proposal position")
    right.set_ylabel("acceptance rate")
    right.set_ylim(0, 1.05)
    right.set_title("acceptance by position")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
