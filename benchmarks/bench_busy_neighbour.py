"""Engine throughput on a quiet machine and beside a busy neighbour, in one run.

A worker's pod rarely has its CPUs to itself: another process (a sidecar, a neighbour on a
shared node, the tokenizer of the API beside it) keeps one of them busy. Every torch operator
splits its work over the intra-op threads and waits for the last, so a thread that shares its
CPU with a busy process slows every step down.

Two engines load the same model, each allowed every CPU this process may use
(``conveyor.engine.runner.cpu_threads``):

- ``fixed``: torch's threads fixed at that count (``cpu_threads=N``), which is what the engine
  did before it tuned them;
- ``tuned``: the default, the count measured step by step under that ceiling
  (``conveyor.engine.runner.thread_tuner``).

Each runs the same workload quiet, and beside a neighbour (a process spinning on one CPU),
for ``--rounds`` rounds in an order that rotates; the fastest run of each configuration
counts (on a shared machine, other jobs only ever slow a run down). The tuned engine's runs
are its steady state: before each, it runs short batches under the run's condition until it
has probed there once (at most ``MAX_PROBE_INTERVAL_S``, 8 s, after the condition changed;
sooner when a neighbour arrives), as a worker does within seconds of a neighbour coming or
going. Prints both and writes JSON to ``benchmarks/results/busy_neighbour_<size>.json``.

    python -m benchmarks.bench_busy_neighbour [--size tiny|small|medium] [--requests N] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any

from benchmarks.bench_continuous_batching import SIZES, run_engine, workload
from benchmarks.common import bench_model, write_results
from conveyor.engine import LLM
from conveyor.engine.runner.cpu_threads import cpu_budget

NEIGHBOUR = "while True: pass"  # one CPU, all of it, all the time
# Requests and the longest output per model size: enough steps that a run lasts seconds, not
# a fraction of one (a short run measures the first steps, not the engine).
WORKLOADS = {"tiny": (128, 200), "small": (64, 150), "medium": (32, 100)}


@contextmanager
def neighbour(busy: bool):
    if not busy:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
    time.sleep(0.3)  # running before the first step
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def settle(llm: LLM, prompts: list[list[int]], lengths: list[int], limit_s: float = 30.0) -> float:
    """Run short batches until the tuned engine has probed under the current condition (a fixed
    one has nothing to settle); how long it took."""
    tuner = llm.engine.thread_tuner
    start = time.perf_counter()
    if tuner is None:
        return 0.0
    probes = tuner.num_probes
    while (tuner.num_probes == probes or tuner.probing) and time.perf_counter() - start < limit_s:
        run_engine(llm, prompts, lengths)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="medium")
    ap.add_argument("--requests", type=int, help="requests per run (default by size: tiny 128, small 64, medium 32)")
    ap.add_argument("--max-output", type=int, help="outputs are 10 to this many tokens (default 200, 150, 100)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.requests = args.requests or WORKLOADS[args.size][0]
    args.max_output = args.max_output or WORKLOADS[args.size][1]

    budget = cpu_budget()
    if budget.threads < 2:
        sys.exit(f"{budget.describe()}: with one thread there is nothing to tune; run on 2 or more CPUs")
    model_dir = bench_model(**SIZES[args.size])
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    engines = {
        "fixed": LLM(str(model_dir), dtype="float32", cpu_threads=budget.threads),
        "tuned": LLM(str(model_dir), dtype="float32"),
    }
    prompts, lengths = workload(args.requests, 0, 10, args.max_output, vocab)
    warm_p, warm_l = workload(8, 99, 4, 8, vocab)
    for llm in engines.values():
        run_engine(llm, warm_p, warm_l)

    cells = [(name, busy) for busy in (False, True) for name in engines]
    runs: dict[str, list[dict[str, Any]]] = {f"{name}_{'busy' if busy else 'quiet'}": [] for name, busy in cells}
    for r in range(args.rounds):
        for name, busy in cells[r % len(cells) :] + cells[: r % len(cells)]:
            llm = engines[name]
            with neighbour(busy):
                settled = settle(llm, warm_p, warm_l)
                result = run_engine(llm, prompts, lengths)
            result["settled_s"] = settled
            result["threads_at_end"] = llm.engine.stats().cpu_threads
            tuner = llm.engine.thread_tuner
            if tuner is not None:
                result["probes"], result["changes"] = tuner.num_probes, tuner.num_changes
            key = f"{name}_{'busy' if busy else 'quiet'}"
            runs[key].append(result)
            print(f"round {r + 1} {key:12s} {result['tokens_per_s']:8.0f} tok/s  ({result['threads_at_end']} threads)")

    best = {key: max(r["tokens_per_s"] for r in rs) for key, rs in runs.items()}
    median = {key: statistics.median(r["tokens_per_s"] for r in rs) for key, rs in runs.items()}
    res: dict[str, Any] = {
        "workload": {"requests": args.requests, "output_tokens": f"10-{args.max_output}", "prompt_tokens": "8-64"},
        "model": {"size": args.size, **{k: v for k, v in SIZES[args.size].items() if k != "name"}},
        "cpu_budget": budget.describe(),
        "neighbour": f"{sys.executable} -c {NEIGHBOUR!r}",
        "rounds": args.rounds,
        "best_tokens_per_s": best,
        "median_tokens_per_s": median,
        "busy_over_quiet": {name: best[f"{name}_busy"] / best[f"{name}_quiet"] for name in engines},
        "runs": runs,
    }
    print(f"\n{args.size} model, {args.requests} requests, outputs 10-{args.max_output}; {budget.describe()}")
    print(f"tok/s over {args.rounds} rounds   quiet (fastest / median)   busy (fastest / median)   busy/quiet")
    for name in engines:
        q, b = best[f"{name}_quiet"], best[f"{name}_busy"]
        qm, bm = median[f"{name}_quiet"], median[f"{name}_busy"]
        print(f"  {name:8s}              {q:8.0f} / {qm:8.0f}        {b:8.0f} / {bm:8.0f}        {b / q:6.2f}")
    write_results(f"busy_neighbour_{args.size}.json", res)


if __name__ == "__main__":
    main()
