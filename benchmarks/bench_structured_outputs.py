"""Structured outputs: what the grammar mask costs per step, and what compiling a schema costs.

Throughput: N requests each decode under a JSON Schema (seeded sampling); then the same
prompts decode free, each for exactly as many tokens as its constrained run produced
(``ignore_eos``), so both runs have the same batches, steps and tokens and differ only by the
mask (filled by llguidance for every constrained row, applied to the logits, and each token fed
back to the matcher). Reported: tokens/s both ways, the overhead per step and per token, and the
time inside the mask itself.

Compile: for each schema, the first compile (a fresh cache) and a cached one, plus a request's
matcher (a copy of the cached one) and the llguidance tokenizer built once per engine.

    python -m benchmarks.bench_structured_outputs [--size tiny|small] [--requests 64] [--quick]
        [--tokenizer PATH]   # also time compiles and masks with another (larger) tokenizer
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import llguidance
import torch

from benchmarks.bench_continuous_batching import SIZES
from benchmarks.common import bench_model, write_results
from conveyor.engine import LLM, SamplingParams, StructuredOutputs
from conveyor.engine.structured.structured_outputs import StructuredOutputManager

_S = {"type": "string", "maxLength": 16}
SCHEMAS: dict[str, dict[str, Any]] = {
    "small": {
        "type": "object",
        "properties": {
            "label": {"enum": ["spam", "ham"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "confidence"],
        "additionalProperties": False,
    },
    "medium": {
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"dish": _S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["dish", "qty"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "table": {"type": "integer", "minimum": 1, "maximum": 40},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 4},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "notes": {"anyOf": [_S, {"type": "null"}]},
        },
        "required": ["table", "items", "code", "notes"],
        "additionalProperties": False,
    },
    "large": {
        "type": "object",
        "properties": {
            f"field_{i}": [
                _S,
                {"type": "integer", "minimum": 0, "maximum": 1000},
                {"enum": ["a", "b", "c", "d"]},
                {"type": "boolean"},
                {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            ][i % 5]
            for i in range(60)
        },
        "required": [f"field_{i}" for i in range(0, 60, 3)],
        "additionalProperties": False,
    },
}


def timed_generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[list, float, int]:
    steps0 = llm.engine.stats().num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - t0, llm.engine.stats().num_steps - steps0


def throughput(llm: LLM, n: int, schema_name: str, repeats: int) -> dict[str, Any]:
    prompts = [f"Order {i}: bring table {i % 9} the soup and the bread, as JSON." for i in range(n)]
    schema = SCHEMAS[schema_name]
    constrained = [
        SamplingParams(max_tokens=400, temperature=1.0, seed=i, structured_outputs=StructuredOutputs(json=schema))
        for i in range(n)
    ]
    structured = llm.engine.structured
    mask_seconds = [0.0]
    best_mask = float("inf")
    apply = structured.apply_masks

    def timing(logits, reqs):
        t = time.perf_counter()
        out = apply(logits, reqs)
        mask_seconds[0] += time.perf_counter() - t
        return out

    structured.apply_masks = timing  # type: ignore[method-assign]
    runs: dict[str, list[float]] = {"constrained": [], "free": []}
    steps: dict[str, int] = {}
    lengths: list[int] = []
    masks = 0
    for _ in range(repeats):
        mask_seconds[0] = 0.0
        before = structured.stats.masks
        outs, dt, k = timed_generate(llm, prompts, constrained)
        masks = structured.stats.masks - before
        best_mask = min(best_mask, mask_seconds[0])
        runs["constrained"].append(dt)
        steps["constrained"] = k
        if not lengths:
            lengths = [len(o.token_ids) for o in outs]
            valid = sum(_is_json(o.text) for o in outs)
            if valid != n:
                raise RuntimeError(f"only {valid} of {n} constrained outputs parse as JSON")
        free = [
            SamplingParams(max_tokens=length, temperature=1.0, seed=i, ignore_eos=True)
            for i, length in enumerate(lengths)
        ]
        outs, dt, k = timed_generate(llm, prompts, free)
        if [len(o.token_ids) for o in outs] != lengths:
            raise RuntimeError("the free run did not produce the same token counts")
        runs["free"].append(dt)
        steps["free"] = k
    structured.apply_masks = apply  # type: ignore[method-assign]
    tokens = sum(lengths)
    # The fastest of the alternating repeats: on a shared machine the other processes only ever
    # add time, so the minimum is the closest to each run's own cost (medians are kept too).
    c, f = min(runs["constrained"]), min(runs["free"])
    return {
        "schema": schema_name,
        "requests": n,
        "tokens": tokens,
        "steps": steps,
        "seconds": {"constrained": c, "free": f},
        "median_seconds": {k: statistics.median(v) for k, v in runs.items()},
        "tokens_per_s": {"constrained": tokens / c, "free": tokens / f},
        "slowdown": c / f - 1,
        "overhead_ms_per_step": (c - f) / steps["constrained"] * 1e3,
        "overhead_us_per_token": (c - f) / tokens * 1e6,
        "mask_us_per_row": best_mask / max(1, masks) * 1e6,
        "mask_ms_per_step": best_mask / steps["constrained"] * 1e3,
        "mask_share_of_constrained_time": best_mask / c,
    }


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def compile_times(tokenizer: Any, vocab_size: int, eos: list[int], repeats: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    probe = StructuredOutputManager(tokenizer, vocab_size, eos)
    _ = probe.ll_tokenizer
    out: dict[str, Any] = {"vocab": vocab_size, "ll_tokenizer_s": time.perf_counter() - t0, "schemas": {}}
    for name, schema in SCHEMAS.items():
        so = StructuredOutputs(json=schema)
        first, cached, matcher = [], [], []
        for _ in range(repeats):
            fresh = StructuredOutputManager(tokenizer, vocab_size, eos)
            fresh._ll_tokenizer = probe.ll_tokenizer  # the tokenizer is built once per engine
            t = time.perf_counter()
            fresh.compile(so)
            first.append(time.perf_counter() - t)
            t = time.perf_counter()
            grammar = fresh.compile(so)
            cached.append(time.perf_counter() - t)
            t = time.perf_counter()
            grammar.matcher()
            matcher.append(time.perf_counter() - t)
        out["schemas"][name] = {
            "bytes": len(json.dumps(schema)),
            "compile_ms": statistics.median(first) * 1e3,
            "cached_us": statistics.median(cached) * 1e6,
            "matcher_us": statistics.median(matcher) * 1e6,
            "mask_us_per_token": mask_time(probe, so),
        }
    return out


def mask_time(manager: StructuredOutputManager, so: StructuredOutputs) -> float:
    """One matcher alone, random logits: the mask per generated token, in microseconds."""
    rng = torch.Generator().manual_seed(0)
    grammar = manager.compile(so)
    total, n = 0.0, 0
    width = manager.vocab_size

    class Row:
        grammar: Any

    for _ in range(3):
        row = Row()
        row.grammar = grammar.matcher()
        while n < 2000:
            logits = torch.randn(1, width, generator=rng)
            t = time.perf_counter()
            logits = manager.apply_masks(logits, [row])
            total += time.perf_counter() - t
            n += 1
            token = int(torch.softmax(logits, -1).multinomial(1, generator=rng))
            if row.grammar.accept(token):
                break
    return total / max(1, n) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["tiny", "small", "medium"], default="small")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokenizer", help="also time compiles and masks with this tokenizer (a directory)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n, repeats = (8, 1) if args.quick else (args.requests, args.repeats)

    path = bench_model(**SIZES[args.size])
    llm = LLM(str(path), dtype="float32")
    timed_generate(llm, ["warm up"] * 4, [SamplingParams(max_tokens=8)] * 4)
    res: dict[str, Any] = {
        "size": args.size,
        "llguidance": llguidance.get_version() if hasattr(llguidance, "get_version") else None,
        "throughput": {name: throughput(llm, n, name, repeats) for name in ("small", "medium")},
        "compile": {
            "model_tokenizer": compile_times(
                llm.engine.tokenizer, llm.engine.vocab_size, sorted(llm.engine.eos_token_ids), 1 if args.quick else 5
            )
        },
    }
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        assert tok.eos_token_id is not None
        res["compile"]["other_tokenizer"] = compile_times(tok, len(tok), [tok.eos_token_id], 1 if args.quick else 5)
        res["compile"]["other_tokenizer"]["path"] = args.tokenizer

    for name, r in res["throughput"].items():
        print(f"\n{args.size} model, {r['requests']} requests under the {name} schema, {r['tokens']} tokens:")
        print(
            f"  tok/s: free {r['tokens_per_s']['free']:8.0f}   constrained {r['tokens_per_s']['constrained']:8.0f}"
            f"   ({r['slowdown']:.1%} slower)"
        )
        print(
            f"  overhead {r['overhead_ms_per_step']:.3f} ms/step, {r['overhead_us_per_token']:.1f} us/token;"
            f" inside the mask {r['mask_ms_per_step']:.3f} ms/step, {r['mask_us_per_row']:.1f} us/row"
            f" ({r['mask_share_of_constrained_time']:.1%} of the constrained run)"
        )
    for label, c in res["compile"].items():
        print(f"\ncompile ({label}, vocab {c['vocab']}; llguidance tokenizer {c['ll_tokenizer_s'] * 1e3:.0f} ms once):")
        for name, s in c["schemas"].items():
            print(
                f"  {name:7} {s['bytes']:6d} B: first {s['compile_ms']:7.2f} ms, cached {s['cached_us']:6.1f} us,"
                f" matcher {s['matcher_us']:6.1f} us, mask {s['mask_us_per_token']:6.1f} us/token"
            )
    write_results(f"structured_outputs_{args.size}.json", res)


if __name__ == "__main__":
    main()
