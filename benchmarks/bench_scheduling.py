"""Scheduling policies side by side on one mixed workload with deadlines, in one run.

The same requests reach each engine while it steps. Arrivals are tied to step numbers and
latencies are counted in engine steps, so every configuration sees the same arrival pattern
and is measured on the same clock whatever else the machine is doing (the CPU this runs on
is shared); wall-clock figures (output tokens per second, decode-step p90) are reported too.

- ``batch``: prompts of 160-352 tokens sharing a 96-token system prefix, up to 192 output
  tokens, priority 1, a deadline ``BATCH_SLACK_STEPS`` after arrival; in three bursts;
- ``interactive``: prompts of 16-48 tokens, up to 24 output tokens, priority 0, a deadline
  ``INTERACTIVE_SLACK_STEPS`` after arrival; one every few steps throughout.

Half of each class stops early (sampled, seeded per request, with a set of stop token ids:
the same output lengths under every configuration), the other half runs to ``max_tokens``.
The KV cache holds only a part of a burst, so admission and preemption matter. Deadlines are
given to the engine as epoch seconds (one second per step from the run's start): only their
order matters to ``edf`` and ``priority``; a miss is a request finished at a later step.

Configurations: the policies ``fcfs``, ``priority``, ``prefix``, ``srpf``, ``edf``; ``fcfs``
with ``admission_policy="predicted"``; ``fcfs`` with ``target_itl_ms`` (1.5x the p50 of a
warm-up run's decode-step times). For each: TTFT p50/p99 in steps (all requests, and the
interactive ones), deadline misses, output tokens per step and per second, preemptions,
steps, and the p90 of the durations of steps that carried decodes. Prints a table, writes
JSON and a PNG plot to benchmarks/results/.

    python -m benchmarks.bench_scheduling [--interactive 64] [--batch 32]
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from benchmarks.common import RESULTS, bench_model, write_results
from conveyor.engine import EngineConfig, LLMEngine, SamplingParams

CONFIGS: dict[str, dict] = {
    "fcfs": {"scheduling_policy": "fcfs"},
    "priority": {"scheduling_policy": "priority"},
    "prefix": {"scheduling_policy": "prefix"},
    "srpf": {"scheduling_policy": "srpf"},
    "edf": {"scheduling_policy": "edf"},
    "fcfs+predicted": {"scheduling_policy": "fcfs", "admission_policy": "predicted"},
    "fcfs+target_itl": {"scheduling_policy": "fcfs"},  # target_itl_ms set from the warm-up
}
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 160
MAX_NUM_SEQS = 32
MAX_NUM_BATCHED_TOKENS = 512
# Deadlines: this many steps after arrival.
INTERACTIVE_SLACK_STEPS = 40
BATCH_SLACK_STEPS = 400
NUM_STOP_IDS = 16  # of a 512-token vocabulary: about a 3% chance to stop at each token


@dataclass
class Arrival:
    step: int
    request_id: str
    kind: str  # interactive | batch
    prompt: list[int]
    params: SamplingParams
    priority: int
    slack_steps: int


def workload(num_interactive: int, num_batch: int, vocab: int, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    stop_ids = rng.sample(range(5, vocab), NUM_STOP_IDS)
    system = [rng.randrange(5, vocab) for _ in range(96)]

    def params(max_tokens: int, i: int) -> SamplingParams:
        if i % 2:
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=seed * 100_003 + i, ignore_eos=True, stop_token_ids=stop_ids
        )

    arrivals = []
    bursts = (0, 150, 300)
    for i in range(num_batch):
        prompt = system + [rng.randrange(5, vocab) for _ in range(rng.randint(64, 256))]
        step = bursts[i * len(bursts) // num_batch]
        arrivals.append(Arrival(step, f"batch-{i}", "batch", prompt, params(192, i), 1, BATCH_SLACK_STEPS))
    for i in range(num_interactive):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(16, 48))]
        arrivals.append(
            Arrival(2 + 4 * i, f"chat-{i}", "interactive", prompt, params(24, i), 0, INTERACTIVE_SLACK_STEPS)
        )
    arrivals.sort(key=lambda a: a.step)
    return arrivals


def run(model: str, arrivals: list[Arrival], **engine_args) -> dict:
    engine = LLMEngine(
        EngineConfig(
            model,
            dtype="float32",
            block_size=BLOCK_SIZE,
            num_kv_blocks=NUM_KV_BLOCKS,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            **engine_args,
        )
    )
    by_id = {a.request_id: a for a in arrivals}
    first_token: dict[str, int] = {}
    finished: dict[str, tuple[int, int]] = {}  # the step it finished at, its output tokens
    decode_steps: list[float] = []
    pending = list(arrivals)
    step = 0
    start_epoch = time.time()
    begin = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            deadline = start_epoch + a.step + a.slack_steps
            engine.add_request(a.request_id, a.prompt, a.params, priority=a.priority, deadline=deadline)
        decoding = any(r.output_token_ids for r in engine.scheduler.running)
        t0 = time.perf_counter()
        for out in engine.step():
            if out.token_ids:
                first_token.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = (step, len(out.token_ids))
        if decoding:
            decode_steps.append(time.perf_counter() - t0)
        step += 1
    wall = time.perf_counter() - begin
    stats = engine.stats()
    assert len(finished) == len(arrivals)

    def ttft(kind: str | None) -> list[float]:
        return [first_token[rid] + 1 - a.step for rid, a in by_id.items() if kind is None or a.kind == kind]

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    misses = {
        kind: sum(1 for rid, a in by_id.items() if a.kind == kind and finished[rid][0] + 1 > a.step + a.slack_steps)
        for kind in ("interactive", "batch")
    }
    output_tokens = sum(n for _, n in finished.values())
    chunks = engine.scheduler.chunk_controller
    return {
        "engine_args": engine_args,
        "ttft_p50_steps": pct(ttft(None), 0.5),
        "ttft_p99_steps": pct(ttft(None), 0.99),
        "interactive_ttft_p50_steps": pct(ttft("interactive"), 0.5),
        "interactive_ttft_p99_steps": pct(ttft("interactive"), 0.99),
        "batch_ttft_p99_steps": pct(ttft("batch"), 0.99),
        "deadline_misses": misses["interactive"] + misses["batch"],
        "deadline_misses_interactive": misses["interactive"],
        "deadline_misses_batch": misses["batch"],
        "output_tokens": output_tokens,
        "output_tokens_per_step": output_tokens / stats.num_steps,
        "output_tokens_per_s": output_tokens / wall,
        "wall_s": wall,
        "preemptions": stats.num_preemptions,
        "steps": stats.num_steps,
        "avg_tokens_per_step": stats.avg_tokens_per_step,
        "decode_step_p50_ms": 1000 * pct(decode_steps, 0.5),
        "decode_step_p90_ms": 1000 * pct(decode_steps, 0.9),
        "final_prefill_budget": chunks.budget if chunks is not None else None,
        "admissions_held_back": getattr(engine.scheduler.admission, "num_held_back", None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interactive", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(
        bench_model(
            "conveyor-bench-llama-small",
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
        )
    )
    arrivals = workload(args.interactive, args.batch, vocab=512)
    warm = run(path, arrivals)
    target_itl_ms = round(1.5 * warm["decode_step_p50_ms"], 2)
    print(f"warm-up: {warm['steps']} steps, decode-step p50 {warm['decode_step_p50_ms']:.2f} ms")
    print(f"target_itl_ms {target_itl_ms}")
    results = {}
    for name, engine_args in CONFIGS.items():
        if name == "fcfs+target_itl":
            engine_args = {**engine_args, "target_itl_ms": target_itl_ms}
        results[name] = run(path, arrivals, **engine_args)
        print(f"  {name} done in {results[name]['wall_s']:.1f} s")

    cols = [
        ("ttft_p50_steps", "TTFT p50", "{:.0f}"),
        ("ttft_p99_steps", "TTFT p99", "{:.0f}"),
        ("interactive_ttft_p99_steps", "chat TTFT p99", "{:.0f}"),
        ("deadline_misses_interactive", "chat misses", "{:d}"),
        ("deadline_misses_batch", "batch misses", "{:d}"),
        ("output_tokens_per_step", "out tok/step", "{:.2f}"),
        ("output_tokens_per_s", "out tok/s", "{:.0f}"),
        ("preemptions", "preempt", "{:d}"),
        ("steps", "steps", "{:d}"),
        ("decode_step_p90_ms", "decode p90 ms", "{:.2f}"),
    ]
    print("\nTTFT in engine steps (arrival to first token); misses: finished after the deadline step")
    print(f"\n{'config':<17}" + "".join(f"{label:>15}" for _, label, _ in cols))
    for name, r in results.items():
        print(f"{name:<17}" + "".join(f"{fmt.format(r[key]):>15}" for key, _, fmt in cols))
    write_results(
        "scheduling.json",
        {
            "workload": {
                "interactive": args.interactive,
                "batch": args.batch,
                "num_kv_blocks": NUM_KV_BLOCKS,
                "block_size": BLOCK_SIZE,
                "max_num_seqs": MAX_NUM_SEQS,
                "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                "warmup_decode_step_p50_ms": warm["decode_step_p50_ms"],
                "target_itl_ms": target_itl_ms,
                "deadline_slack_steps": {"interactive": INTERACTIVE_SLACK_STEPS, "batch": BATCH_SLACK_STEPS},
            },
            "results": results,
        },
    )
    _plot(results)


def _plot(results: dict[str, dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    panels = [
        ("interactive_ttft_p99_steps", "interactive TTFT p99 (steps)"),
        ("batch_ttft_p99_steps", "batch TTFT p99 (steps)"),
        ("deadline_misses", "deadline misses (all)"),
        ("output_tokens_per_step", "output tokens / step"),
        ("preemptions", "preemptions"),
        ("decode_step_p90_ms", "decode-step p90 (ms)"),
    ]
    names = list(results)
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        ax.bar(names, [results[n][key] for n in names], color=["#4c72b0" if n == "fcfs" else "#8fa8c8" for n in names])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.suptitle("Scheduling policies on one mixed workload with deadlines (tiny model, CPU)")
    fig.tight_layout()
    out = RESULTS / "scheduling.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
