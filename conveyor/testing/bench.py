"""``conveyor bench``: how fast this machine runs a model, on a synthetic batch workload;
``conveyor bench --cold-start``: how long a fresh process takes to build the engine, by phase.

Random token-id prompts (optionally behind a shared prefix, as with a common system prompt)
and output lengths drawn from a range with EOS ignored, all submitted at once, the way a
batch job feeds the engine. Reports throughput and per-request latency percentiles.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams

MAX_BENCH_REQUESTS = 100_000
MAX_BENCH_TOKENS = 1_000_000


@dataclass(frozen=True)
class TokenRange:
    low: int
    high: int

    @classmethod
    def parse(cls, text: str, name: str) -> TokenRange:
        """``"N"`` or ``"LOW-HIGH"``."""
        try:
            low, _, high = text.partition("-")
            value = cls(int(low), int(high or low))
        except ValueError:
            raise ValueError(f"{name} must be N or LOW-HIGH, got {text!r}") from None
        if not 1 <= value.low <= value.high <= MAX_BENCH_TOKENS:
            raise ValueError(f"{name} must satisfy 1 <= LOW <= HIGH <= {MAX_BENCH_TOKENS}, got {text!r}")
        return value

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass
class BenchResult:
    model: str
    requests: int
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    ttft_p50: float
    ttft_p90: float
    tpot_p50: float | None
    e2e_p50: float
    e2e_p90: float
    preemptions: int
    engine: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_bench(
    model: str,
    *,
    requests: int,
    prompt_tokens: TokenRange,
    output_tokens: TokenRange,
    shared_prefix: int = 0,
    seed: int = 0,
    engine_args: dict[str, Any] | None = None,
) -> BenchResult:
    if not 1 <= requests <= MAX_BENCH_REQUESTS:
        raise ValueError(f"requests must be from 1 to {MAX_BENCH_REQUESTS}, got {requests}")
    if not 0 <= shared_prefix <= MAX_BENCH_TOKENS:
        raise ValueError(f"shared_prefix must be from 0 to {MAX_BENCH_TOKENS}, got {shared_prefix}")
    llm = LLM(model, **(engine_args or {}))
    vocab = llm.engine.vocab_size
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix)]
    prompts = [prefix + [rng.randrange(vocab) for _ in range(prompt_tokens.draw(rng))] for _ in range(requests)]
    params = [
        SamplingParams(max_tokens=output_tokens.draw(rng), temperature=0.0, ignore_eos=True) for _ in range(requests)
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    failed = [o for o in outs if o.error]
    if failed:
        raise ValueError(f"{len(failed)} requests were refused, e.g.: {failed[0].error}")
    produced = sum(len(o.token_ids) for o in outs)
    prompt_total = sum(len(p) for p in prompts)
    tpots = [t for o in outs if (t := o.metrics.time_per_output_token) is not None]
    # Every finished request has these times; the filter only narrows the Optional type.
    ttfts = [t for o in outs if (t := o.metrics.time_to_first_token) is not None]
    e2es = [t for o in outs if (t := o.metrics.e2e_latency) is not None]
    stats = llm.engine.stats()
    return BenchResult(
        model=model,
        requests=requests,
        prompt_tokens=prompt_total,
        cached_prompt_tokens=sum(o.num_cached_tokens for o in outs),
        output_tokens=produced,
        seconds=seconds,
        output_tokens_per_s=produced / seconds,
        total_tokens_per_s=(produced + prompt_total) / seconds,
        requests_per_s=requests / seconds,
        ttft_p50=_quantile(ttfts, 0.5),
        ttft_p90=_quantile(ttfts, 0.9),
        tpot_p50=_quantile(tpots, 0.5) if tpots else None,
        e2e_p50=_quantile(e2es, 0.5),
        e2e_p90=_quantile(e2es, 0.9),
        preemptions=stats.num_preemptions,
        engine={
            "device": str(llm.engine.runner.device),
            "dtype": str(llm.engine.runner.dtype),
            "attention": llm.engine.runner.backend.name,
            "kv_blocks": stats.kv_blocks_total,
            "block_size": llm.engine.config.cache.block_size,
            "max_num_seqs": llm.engine.config.scheduler.max_num_seqs,
        },
    )


def format_result(r: BenchResult) -> str:
    tpot = f"{r.tpot_p50 * 1e3:.1f} ms" if r.tpot_p50 is not None else "n/a"
    return "\n".join([
        f"{r.requests} requests, {r.prompt_tokens} prompt tokens ({r.cached_prompt_tokens} from the prefix cache), "
        f"{r.output_tokens} output tokens in {r.seconds:.2f} s on {r.engine['device']} ({r.engine['dtype']}, "
        f"{r.engine['attention']} attention)",
        f"  throughput   {r.output_tokens_per_s:10.1f} output tok/s  {r.total_tokens_per_s:10.1f} total tok/s  "
        f"{r.requests_per_s:8.2f} req/s",
        f"  latency p50  ttft {r.ttft_p50 * 1e3:.1f} ms  tpot {tpot}  e2e {r.e2e_p50:.2f} s   "
        f"(p90 ttft {r.ttft_p90 * 1e3:.1f} ms, e2e {r.e2e_p90:.2f} s)",
        f"  preemptions  {r.preemptions}",
    ])  # fmt: skip


# ---- cold start ---------------------------------------------------------------------------

COLD_START_PHASES = ("import", "weights", "kv_cache", "cuda_graphs", "other")
MAX_COLD_START_RUNS = 20


@dataclass
class ColdStartRun:
    """One fresh process's start, in seconds: ``import`` (process start to the engine
    beginning to load: the interpreter, torch, transformers, the engine), ``weights``,
    ``kv_cache``, ``cuda_graphs`` (None: not captured), ``other`` (the rest), ``total``
    (process start to the engine built)."""

    phases: dict[str, float | None]
    total: float
    tokenizer: float  # the tokenizer's part of weights
    process_start_source: str
    device: str
    dtype: str

    @classmethod
    def measure(cls, process_started_at: float, source: str, engine: Any, built_at: float) -> ColdStartRun:
        t = engine.startup
        total = built_at - process_started_at
        imports = max(0.0, t.started_at - process_started_at)
        phases: dict[str, float | None] = {
            "import": imports,
            "weights": t.weights,
            "kv_cache": t.kv_cache,
            "cuda_graphs": t.cuda_graphs,
        }
        phases["other"] = max(0.0, total - sum(v or 0.0 for v in phases.values()))
        return cls(phases, total, t.tokenizer, source, str(engine.runner.device), str(engine.runner.dtype))


@dataclass
class ColdStartResult:
    model: str
    runs: list[ColdStartRun]

    @property
    def median(self) -> dict[str, float | None]:
        """Each phase's median over the runs (and ``total``'s)."""
        out: dict[str, float | None] = {}
        for name in (*COLD_START_PHASES, "total"):
            values = [r.total if name == "total" else r.phases[name] for r in self.runs]
            known = [v for v in values if v is not None]
            out[name] = statistics.median(known) if known else None
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "runs": [asdict(r) for r in self.runs], "median": self.median}


def _child_main(spec_json: str) -> None:
    """In the fresh process: build the engine as a worker would and print the timings."""
    from conveyor.engine.config import EngineConfig
    from conveyor.engine.core.llm_engine import LLMEngine
    from conveyor.engine.core.startup import process_start_time

    engine = LLMEngine(EngineConfig(**json.loads(spec_json)))
    built_at = time.time()
    started_at, source = process_start_time()
    run = ColdStartRun.measure(started_at, source, engine, built_at)
    print(_CHILD_MARK + json.dumps(asdict(run)), flush=True)


_CHILD_MARK = "conveyor-cold-start: "


def run_cold_start(
    model: str, *, engine_args: dict[str, Any] | None = None, repeat: int = 3, timeout: float = 1800.0
) -> ColdStartResult:
    """Start ``repeat`` fresh Python processes one after the other, each importing the
    engine and building an ``LLMEngine(EngineConfig(model, **engine_args))``; their phases.
    The first run may pay for a cold page cache (files read from disk), later ones not."""
    if not 1 <= repeat <= MAX_COLD_START_RUNS:
        raise ValueError(f"repeat must be from 1 to {MAX_COLD_START_RUNS}, got {repeat}")
    spec = json.dumps({**(engine_args or {}), "model": model})
    root = str(Path(__file__).resolve().parents[2])  # where the conveyor package lies
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    runs = []
    for _ in range(repeat):
        proc = subprocess.run(
            [sys.executable, "-m", "conveyor.testing.bench", "--cold-start-child", spec],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith(_CHILD_MARK)]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ValueError(f"the cold-start process for {model} failed (exit {proc.returncode}): {tail}")
        runs.append(ColdStartRun(**json.loads(lines[-1][len(_CHILD_MARK) :])))
    return ColdStartResult(model, runs)


def _phases_line(phases: dict[str, float | None], total: float | None) -> str:
    def show(v: float | None) -> str:
        return "off" if v is None else f"{v:.2f} s"

    return f"total {show(total)}: " + ", ".join(f"{name} {show(phases.get(name))}" for name in COLD_START_PHASES)


def format_cold_start(result: ColdStartResult) -> str:
    first = result.runs[0]
    lines = [
        f"cold start of {result.model} on {first.device} ({first.dtype}): {len(result.runs)} fresh Python "
        f"process(es), process start to engine built (start time from the {first.process_start_source})"
    ]
    for i, run in enumerate(result.runs, 1):
        lines.append(f"  run {i}    {_phases_line(run.phases, run.total)} (tokenizer {run.tokenizer:.2f} s of weights)")
    median = result.median
    lines.append(f"  median   {_phases_line(median, median['total'])}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m conveyor.testing.bench --cold-start-child SPEC (what run_cold_start starts)
    if len(sys.argv) != 3 or sys.argv[1] != "--cold-start-child":
        sys.exit(
            "usage: python -m conveyor.testing.bench --cold-start-child '{\"model\": ...}' (run by conveyor bench)"
        )
    _child_main(sys.argv[2])
