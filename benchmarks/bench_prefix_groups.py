"""Shards cut by shared prefix against today's input-order shards, in one run.

For each shape (``benchmarks/prefix_shapes.py``: many questions per document, few-shot, one
system prompt, a few long documents), in prefix order and shuffled, a job is run grouped
(``shard_order="prefix"``) and in input order through 1, 2 and 4 workers on CPU. A worker is a
``WorkerContext`` of its own (its own engine and prefix cache) in this process, whose threads
take shard messages from one queue as a broker would hand them out, each message a turn
(``conveyor.worker.execution.shard_turns``: the affinity included). Reported per run: prefill tokens
computed (prompt tokens less those served from the prefix cache) against the ideal (each
distinct prefix computed once: the token prefix tree of all prompts, in whole KV blocks), wall
time and items/s. Then intake alone (no engine): the time and peak memory to validate and
shard a large many-questions input, grouped and not (``--intake-lines``, 1,000,000 for the
figure in the docs), each in a fresh process.

    python benchmarks/bench_prefix_groups.py                      # a few minutes on 2 cores
    python benchmarks/bench_prefix_groups.py --intake-lines 1000000 --skip-runs

Writes ``benchmarks/results/prefix_groups.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import prefix_shapes as shapes

if TYPE_CHECKING:
    from conveyor.worker.entrypoints.client import Client
    from conveyor.worker.execution.context import WorkerContext

BLOCK = 16  # the engine's default KV block: a prefix is cached in whole blocks
SHARD_SIZE = 10  # the default job here is ~100 lines: 10 a shard gives every worker several


def all_shapes(scale: int) -> list[shapes.Shape]:
    out = []
    for shuffled in (False, True):
        out += [
            shapes.many_questions(10 * scale, 10, 3000, shuffled=shuffled),
            shapes.few_shot(100 * scale, 2000, shuffled=shuffled),
            shapes.one_system_prompt(100 * scale, 600, shuffled=shuffled),
            shapes.long_documents(2 * scale, 50, 9000, shuffled=shuffled),  # ~6,000 tokens each
        ]
    return out


def ideal_prefill(token_lists: list[list[int]]) -> int:
    """Prompt tokens computed when each distinct prefix is computed once, in whole blocks (the
    last token of a prompt is always computed)."""
    total = 0
    prev: list[int] = []
    for ids in sorted(token_lists):
        common = 0
        for a, b in zip(prev, ids, strict=False):
            if a != b:
                break
            common += 1
        reused = (min(common, len(ids) - 1) // BLOCK) * BLOCK
        total += len(ids) - reused
        prev = ids
    return total


def prompt_ids(ctx: WorkerContext, shape: shapes.Shape) -> list[list[int]]:
    tok = ctx.host().tokenizer
    out = []
    for line in shape.lines:
        text = tok.apply_chat_template(line["body"]["messages"], tokenize=False, add_generation_prompt=True)
        out.append(list(tok.encode(text, add_special_tokens=False)))
    return out


def run_one(client: Client, workers: list[WorkerContext], shape: shapes.Shape, order: str) -> dict[str, Any]:
    from sqlalchemy import func, select

    from conveyor.worker.execution.shard_turns import run_next_shard
    from conveyor.worker.jobs.lifecycle import get_job
    from conveyor.worker.store.models import Item

    data = b"".join(json.dumps(line).encode() + b"\n" for line in shape.lines)
    began = time.perf_counter()
    job = client.submit(io.BytesIO(data), workers[0].model, SHARD_SIZE, enqueue=False, shard_order=order)
    intake = time.perf_counter() - began
    messages: queue.Queue[int] = queue.Queue()
    for index in range(job["num_shards"]):
        messages.put(index)

    def consume(ctx: WorkerContext) -> None:
        while True:
            try:
                index = messages.get_nowait()
            except queue.Empty:
                return
            run_next_shard(ctx, job["id"], index)

    threads = [
        threading.Thread(target=consume, args=(ctx,)) for ctx in workers for _ in range(ctx.settings.worker_concurrency)
    ]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    final = get_job(client.db, job["id"])
    assert final["status"] == "completed", final["status"]
    assert final["request_counts"]["failed"] == 0, f"{shape.name}: requests failed (prompts too long?)"
    with client.db.connect() as conn:
        prompt, cached = conn.execute(
            select(func.sum(Item.prompt_tokens), func.sum(Item.cached_tokens)).where(Item.job_id == job["id"])
        ).one()
    return {
        "intake_s": round(intake, 3),
        "wall_s": round(wall, 3),
        "items_per_s": round(len(shape.lines) / wall, 1),
        "prompt_tokens": int(prompt),
        "prefill_computed": int(prompt - cached),
        "estimated_shared_prefix": final["prefix"]["estimated_shared_prefix"],
        "num_shards": final["num_shards"],
    }


def run_engines(root: Path, scale: int) -> list[dict[str, Any]]:
    # Imported here: the intake children measure their peak memory without torch loaded.
    from conveyor.testing.tiny_models import build_tiny_model
    from conveyor.worker.core.settings import Settings
    from conveyor.worker.entrypoints.client import Client
    from conveyor.worker.execution.context import WorkerContext

    model = build_tiny_model(root / "tiny-llama", "llama", max_position_embeddings=8192)
    values: dict[str, Any] = {
        "home": str(root / "home"), "model": str(model), "worker_concurrency": 2,
        "engine_args": {"num_kv_blocks": 2048, "max_num_seqs": 32, "max_model_len": 8192},
        "item_commit_interval_seconds": 0.05,
    }  # fmt: skip
    settings = Settings(**values)
    client = Client(settings)  # (creates the embedded database first)
    workers = [WorkerContext.create(settings, str(model)) for _ in range(4)]
    rows = []
    for shape in all_shapes(scale):
        ideal = ideal_prefill(prompt_ids(workers[0], shape))
        for n in (1, 2, 4):
            for order in ("input", "prefix"):
                fig = run_one(client, workers[:n], shape, order)
                fig.update(shape=shape.name, lines=len(shape.lines), workers=n, order=order, ideal_prefill=ideal)
                fig["prefill_over_ideal"] = round(fig["prefill_computed"] / ideal, 3)
                rows.append(fig)
                print(
                    f"{shape.name:22s} workers={n} {order:6s} prefill/ideal {fig['prefill_over_ideal']:5.2f}  "
                    f"wall {fig['wall_s']:6.2f} s  {fig['items_per_s']:6.1f} items/s  intake {fig['intake_s']:.2f} s",
                    flush=True,
                )
    for ctx in workers:
        ctx.close()
    client.close()
    return rows


def _peak_rss_mb() -> float:
    """This process's peak resident memory (``VmHWM``: unlike ``ru_maxrss``, not the forking
    parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def intake_child(lines: int, order: str, root: str) -> None:
    """One intake in this (fresh) process: prints its seconds and peak RSS."""
    from conveyor.worker.batchio.prefix_signature import grouping_key
    from conveyor.worker.batchio.records import InputFormat
    from conveyor.worker.core.limits import InputLimits
    from conveyor.worker.jobs.intake import Grouping, ingest
    from conveyor.worker.store.objects.local import LocalStore

    path = Path(root) / "input.jsonl"
    base = _peak_rss_mb()
    grouping = Grouping(grouping_key("job:x", "m"), 64 << 20) if order == "prefix" else None
    store = LocalStore(Path(root) / order)
    began = time.perf_counter()
    with path.open("rb") as source:
        result = ingest(
            source, store, "batch_bench", limits=InputLimits(max_lines=lines + 1, max_input_bytes=4 << 30),
            input_format=InputFormat.jsonl, shard_size=256, max_shards=100_000, copy_input=False, grouping=grouping,
        )  # fmt: skip
    seconds = time.perf_counter() - began
    peak = _peak_rss_mb()
    print(json.dumps({"seconds": seconds, "peak_rss_mb": peak, "rss_before_mb": base,
                      "shards": len(result.shards), "valid": result.valid}))  # fmt: skip


def write_intake_input(path: Path, lines: int) -> None:
    """Many questions per document, shuffled, written line by line: ``lines // 10`` documents
    of 300 bytes (kept short so that a million lines stay a few hundred MB), each line one of
    them drawn at random and its own question."""
    rng = random.Random(0)
    docs = [f"Document {d}: " + shapes.words(random.Random(d), 300) for d in range(max(1, lines // 10))]
    with path.open("wb") as f:
        for i in range(lines):
            user = f"{rng.choice(docs)}\n\nQuestion: {shapes.words(rng, 40)}"
            body = {"messages": [{"role": "system", "content": "Answer from the document only."},
                                 {"role": "user", "content": user}], "max_tokens": 4}  # fmt: skip
            line = {"custom_id": f"q-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            f.write(json.dumps(line).encode() + b"\n")


def run_intakes(root: Path, lines: int) -> list[dict[str, Any]]:
    write_intake_input(root / "input.jsonl", lines)
    rows = []
    for order in ("input", "prefix"):
        out = subprocess.run(
            [sys.executable, __file__, "--intake-child", order, "--intake-lines", str(lines), "--root", str(root)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        fig = json.loads(out.stdout.strip().splitlines()[-1])
        fig.update(order=order, lines=lines)
        rows.append(fig)
        print(
            f"intake {lines} lines {order:6s} {fig['seconds']:.1f} s, peak RSS {fig['peak_rss_mb']:.0f} MB", flush=True
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=1, help="multiplies the jobs' sizes")
    parser.add_argument("--intake-lines", type=int, default=100_000)
    parser.add_argument("--skip-runs", action="store_true", help="only the intake figures")
    parser.add_argument("--intake-child", choices=("input", "prefix"), help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.intake_child:
        intake_child(args.intake_lines, args.intake_child, args.root)
        return
    from benchmarks.common import write_results

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results: dict[str, Any] = {"shard_size": SHARD_SIZE, "block_size": BLOCK}
        results["intake"] = run_intakes(root, args.intake_lines)
        if not args.skip_runs:
            results["runs"] = run_engines(root, args.scale)
    name = "prefix_groups.json" if not args.skip_runs else f"prefix_groups_intake_{args.intake_lines}.json"
    write_results(name, results)


if __name__ == "__main__":
    main()
