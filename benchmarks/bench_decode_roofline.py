"""Decode against the memory roofline: how close a decode step comes to the time its bytes
need at the GPU's measured copy bandwidth.

A decode step must read every weight once and the KV of every running request; at batch 1
the weights dominate, at batch 256 and long contexts the KV does. For batch 1, 64 and 256 at
contexts 512 and 2048 (Qwen3-0.6B's shape, random weights, bf16), the engine's whole step
(scheduling, CUDA-graph replay, sampling) is timed over ``--steps`` decode-only steps, and
its bytes over that time are set against the device-to-device copy bandwidth measured in the
same run. The attention kernel is then timed alone on the same batch shape
(``benchmarks.bench_attention``): its KV bytes over its time, and its share of the step.

    python -m benchmarks.bench_decode_roofline --out roofline.json [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_attention import bench_decode
from benchmarks.common import RESULTS, copy_bandwidth_gbs, gpu_tag, interpret_kernels_without_gpu, machine_info
from conveyor.engine import LLM, SamplingParams
from conveyor.testing.tiny_models import build_shaped_model, shaped_model_dir

SHAPE = "qwen3-0.6b"
# Tokens beyond the context a point's requests may reach: the first decode while the last are
# still prefilled (256 prompts of 2048 tokens take 64 steps of 8192), then the timed steps.
MARGIN = 128


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--models", type=Path, default=None, help="where the shaped checkpoint is built (or found)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 64 256 (dry run: 1 4)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="default 512 2048 (dry run: 16 48)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per point (default 20; dry run 3)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: checks the script")
    args = ap.parse_args(argv)
    interpret_kernels_without_gpu()
    dry = args.dry_run
    batches = args.batches or ([1, 4] if dry else [1, 64, 256])
    contexts = args.contexts or ([16, 48] if dry else [512, 2048])
    steps = args.steps or (3 if dry else 20)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    models = args.models or Path(tempfile.gettempdir()) / "conveyor-shaped-models"
    model = build_shaped_model(shaped_model_dir(models, SHAPE, dry_run=dry), SHAPE, dry_run=dry)
    copy_gbs = copy_bandwidth_gbs(2 << 30 if device == "cuda" else 64 << 20, device)
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    if device == "cuda":
        torch.cuda.empty_cache()  # the copy's buffers, cached by torch, would count as used below
    llm = LLM(
        str(model),
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        max_num_seqs=max(batches),
        # Room for the first requests of a point to decode while the last still prefill.
        max_model_len=max(contexts) + MARGIN,
        enable_prefix_caching=False,
        cuda_graph_max_batch_size=max(batches),
        # 256 x (2048 + MARGIN) tokens of KV fit in 85% of an 80 GB card; the rest is the
        # attention-alone timing's own caches.
        gpu_memory_utilization=0.85,
    )
    runner, spec = llm.engine.runner, llm.engine.runner.model_spec
    seen: set[int] = set()
    weight_bytes = 0
    for p in runner.model.parameters():  # a tied embedding and head counted once
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weight_bytes += p.numel() * p.element_size()
    kv_token_bytes = 2 * spec.num_layers * runner.num_kv_heads * spec.head_dim * runner.kv_cache.element_size()
    out = args.out or RESULTS / f"roofline_{gpu_tag() if device == 'cuda' else 'cpu'}.json"
    report: dict[str, Any] = {
        "benchmark": "decode_roofline",
        "shape": SHAPE,
        "dtype": str(dtype),
        "copy_bandwidth_gbs": copy_gbs,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_token_bytes,
        "cuda_graphs": runner.graphs is not None,
        "attention_backend": runner.backend.name,
        "steps_timed": steps,
        "machine": machine_info(),
        "rows": [],
    }
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped from outside: keep the rows so far
    print(f"{'batch':>5} {'ctx':>5} | {'step ms':>8} {'GB/s':>6} {'%copy':>6} | ", end="")
    print(f"{'attn ms':>8} {'%copy':>6} {'attn/step':>9}")
    try:
        for ctx in contexts:
            for batch in batches:
                row = decode_point(llm, batch, ctx, steps)
                moved = weight_bytes + batch * row["mean_context"] * kv_token_bytes
                row["bytes_per_step"] = moved
                row["gbs"] = moved / (row["step_ms"] * 1e-3) / 1e9
                row["frac_copy_bw"] = row["gbs"] / copy_gbs
                attn = bench_decode(
                    batch,
                    ctx,
                    num_q_heads=spec.num_heads,
                    num_kv_heads=runner.num_kv_heads,
                    head_dim=spec.head_dim,
                    block_size=runner.block_size,
                    dtype=dtype,
                    copy_gbs=copy_gbs,
                    splits=0,
                    device=device,
                )
                row["attention_alone"] = attn
                # The engine replays it from a graph: that time, where a GPU could capture it.
                alone = attn.get("triton_graph", attn["triton_auto"])
                row["attention_share_of_step"] = spec.num_layers * alone["ms"] / row["step_ms"]
                report["rows"].append(row)
                _write(out, report)
                share, step_frac = 100 * row["attention_share_of_step"], 100 * row["frac_copy_bw"]
                print(
                    f"{batch:>5} {ctx:>5} | {row['step_ms']:>8.3f} {row['gbs']:>6.0f} {step_frac:>5.1f}% | "
                    f"{alone['ms']:>8.4f} {100 * alone['frac_copy_bw']:>5.1f}% {share:>8.1f}%",
                    flush=True,
                )
                if device == "cuda":
                    torch.cuda.empty_cache()
    finally:
        _write(out, report)
    return 0


def decode_point(llm: LLM, batch: int, ctx: int, steps: int) -> dict[str, Any]:
    """``batch`` requests with ``ctx``-token prompts, prefilled, then ``steps`` decode-only
    engine steps timed; the requests are aborted afterwards."""
    engine = llm.engine
    rng = random.Random(ctx * 1000 + batch)
    ids = [f"roof-{ctx}-{batch}-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=engine.max_model_len - ctx, temperature=0.0, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, [rng.randrange(engine.vocab_size) for _ in range(ctx)], params)
    started: set[str] = set()
    while len(started) < batch:  # prefill, until every request has its first token
        started.update(o.request_id for o in engine.step() if o.token_ids)
    engine.step()  # one decode step untimed
    before = {r.request_id: r.num_tokens for r in engine.scheduler.running}
    preempted = engine.stats().num_preemptions
    replays = sum(engine.runner.graphs.replays.values()) if engine.runner.graphs is not None else 0
    _sync()
    begin = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync()
    seconds = time.perf_counter() - begin
    after = {r.request_id: r.num_tokens for r in engine.scheduler.running}
    graph_steps = (sum(engine.runner.graphs.replays.values()) - replays) if engine.runner.graphs is not None else 0
    # Decode-only: the same requests ran every timed step, one token each, none preempted.
    decode_only = (
        len(before) == batch
        and after.keys() == before.keys()
        and all(after[r] - before[r] == steps for r in before)
        and engine.stats().num_preemptions == preempted
    )
    mean_context = sum(before[r] + after.get(r, before[r]) for r in before) / (2 * max(1, len(before)))
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "batch": batch,
        "context": ctx,
        "mean_context": mean_context,
        "step_ms": seconds / steps * 1e3,
        "output_tok_s": batch * steps / seconds,
        "graph_replays": graph_steps,
        "decode_only": decode_only,
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _write(out: Path, report: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
