"""Offline throughput on nano-vllm's workload: our engine against transformers' static
batched ``generate`` and transformers' continuous batching, the same sequences for all three,
side by side on one machine in one run.

The workload is nano-vllm's ``bench.py``: random token ids below 10,000, prompt and output
lengths each uniform in 100..1024, EOS ignored, temperature 0.6. The model has Qwen3-0.6B's
shape with random weights (``conveyor.testing.tiny_models.REAL_SHAPES``). Static batching runs the sequences
in arrival order, ``--static-batch`` at a time, each batch to its longest output; only the
tokens each sequence asked for count. Each system runs in its own process, so one model and
one cache hold the GPU at a time, and gets its own time limit: whichever finish are reported.
On a GPU our engine then also runs nano-vllm's whole 256-sequence workload, the figure to set
beside the published ones (``PUBLISHED``).

    python -m benchmarks.bench_throughput --out throughput.json [--num-seqs 128] [--dry-run]

Writes JSON (one entry per system as it finishes) to ``--out`` (default
``benchmarks/results/throughput_<gpu>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import StoppingCriteria

from benchmarks.common import RESULTS, gpu_tag, machine_info
from conveyor.testing.tiny_models import DRY_RUN_SHAPE, build_shaped_model, shaped_model_dir

SHAPE = "qwen3-0.6b"
SYSTEMS = ("engine", "hf_static", "hf_continuous")
TEMPERATURE = 0.6
# Published figures for the same workload, quoted beside ours (not measured here).
PUBLISHED = [
    {
        "system": "nano-vllm",
        "gpu": "RTX 4070 Laptop (8 GB)",
        "output_tok_s": 1434,
        "sequences": 256,
        "source": "nano-vllm README: 133,966 tokens in 93.41 s",
    },
    {"system": "vLLM", "gpu": "A100", "output_tok_s": 9500, "sequences": 256, "source": "issue 33, approximate"},
]
# Per system, the seconds its process may take (model load and warm-up included). On an H100
# transformers' static generate took over a minute for one batch of 48 (about 1,000 decode
# steps): the default 32 sequences leave each baseline twice the time it needs.
LIMITS_S = {"engine": 70.0, "hf_static": 150.0, "hf_continuous": 150.0}
DEFAULT_SEQUENCES = 32


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def nano_vllm_workload(
    num_seqs: int, *, lo: int = 100, hi: int = 1024, seed: int = 0, max_token_id: int = 10000
) -> Workload:
    """nano-vllm's bench.py workload (its seed, its ranges; ``max_token_id`` lower for a dry
    run's small vocabulary)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(lo, hi))] for _ in range(num_seqs)]
    return Workload(prompts, [rng.randint(lo, hi) for _ in range(num_seqs)])


class Progress:
    """What a system has done so far, in a file its parent reads if the system runs out of
    time: a slow baseline stopped at its limit still leaves a rate (and how long its set-up
    took)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.started = time.perf_counter()
        self.generating_since: float | None = None
        self.state: dict[str, Any] = {"phase": "loading"}
        self._written = 0.0
        self._write(force=True)

    def phase(self, name: str) -> None:
        self.state["phase"] = name
        self.state[f"{name}_at_s"] = round(time.perf_counter() - self.started, 1)
        if name == "generating":
            self.generating_since = time.perf_counter()
        self._write(force=True)

    def done(self, sequences: int, output_tokens: int, *, throttled: bool = False) -> None:
        assert self.generating_since is not None
        if throttled and time.perf_counter() - self._written < 1.0:
            return
        seconds = time.perf_counter() - self.generating_since
        self.state.update(sequences_done=sequences, output_tokens=output_tokens, seconds_generating=round(seconds, 2))
        self.state["output_tok_s"] = output_tokens / seconds if seconds > 0 else None
        self._write()

    def _write(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.path is None or (not force and now - self._written < 1.0):
            return
        self._written = now
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        tmp.replace(self.path)


# ---------------------------------------------------------------------------------------------
# The systems, each run in a child process: ``--system NAME --workload FILE --result FILE``.
def run_engine(model: str, work: Workload, device: str, dtype: str, full: Workload | None) -> dict[str, Any]:
    from conveyor.engine import LLM

    begin = time.perf_counter()
    llm = LLM(model, dtype=dtype, device=device, max_model_len=2048)
    startup = time.perf_counter() - begin
    _engine_generate(
        llm, nano_vllm_workload(8, lo=16, hi=64, seed=1, max_token_id=500)
    )  # warm-up: prefill kernels compiled
    result: dict[str, Any] = {"startup_s": round(startup, 1), **_engine_generate(llm, work)}
    runner = llm.engine.runner
    result["kv_cache"] = {
        "blocks": runner.num_blocks,
        "tokens": runner.num_blocks * runner.block_size,
        "gib": round(runner.kv_cache.numel() * runner.kv_cache.element_size() / 2**30, 2),
        "sized_by": runner.kv_budget_source,
    }
    result["cuda_graphs"] = runner.graphs is not None
    result["attention_backend"] = runner.backend.name
    result["stats"] = asdict(llm.engine.stats())
    if full is not None:  # nano-vllm's whole workload, for the published comparison
        result["nano_vllm_full"] = _engine_generate(llm, full)
    return result


def _engine_generate(llm, work: Workload) -> dict[str, Any]:
    from conveyor.engine import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=TEMPERATURE, ignore_eos=True) for m in work.max_tokens]
    _sync()
    begin = time.perf_counter()
    outs = llm.generate(work.prompts, params)
    _sync()
    seconds = time.perf_counter() - begin
    produced = sum(len(o.token_ids) for o in outs)
    if produced != work.output_tokens:
        raise RuntimeError(f"the engine produced {produced} tokens, {work.output_tokens} asked")
    return _rate(produced, seconds, len(work.prompts))


def run_hf_static(
    model_path: str, work: Workload, device: str, dtype: str, batch: int, progress: Progress
) -> dict[str, Any]:
    model = _hf_model(model_path, device, dtype)
    pad = 0
    progress.phase("warming")
    _hf_static_batch(model, nano_vllm_workload(2, lo=16, hi=32, seed=1, max_token_id=500), pad)  # warm-up
    _sync()
    progress.phase("generating")
    begin = time.perf_counter()
    steps = 0
    for i in range(0, len(work.prompts), batch):
        part = Workload(work.prompts[i : i + batch], work.max_tokens[i : i + batch])
        steps += _hf_static_batch(model, part, pad, _StepCounter(progress, work.max_tokens[:i], part.max_tokens))
        _sync()
        progress.done(i + len(part.prompts), sum(work.max_tokens[: i + len(part.prompts)]))
        print(f"hf_static: {i + len(part.prompts)}/{len(work.prompts)} sequences", flush=True)
    _sync()
    result = _rate(work.output_tokens, time.perf_counter() - begin, len(work.prompts))
    result.update(batch_size=batch, decode_steps=steps, attn_implementation=model.config._attn_implementation)
    return result


class _StepCounter(StoppingCriteria):
    """A stopping criterion that never stops: it counts a static batch's decode steps into
    the progress file, so a batch cut off by its time limit still leaves a rate (the tokens
    each sequence asked for that were made so far)."""

    def __init__(self, progress: Progress, earlier: list[int], asked: list[int]) -> None:
        self.progress, self.asked, self.steps = progress, asked, 0
        self.earlier_sequences, self.earlier_tokens = len(earlier), sum(earlier)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.steps += 1
        made = sum(min(self.steps, m) for m in self.asked)
        finished = sum(m <= self.steps for m in self.asked)
        self.progress.done(self.earlier_sequences + finished, self.earlier_tokens + made, throttled=True)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def _hf_static_batch(model, work: Workload, pad: int, counter: _StepCounter | None = None) -> int:
    """One static batch, left-padded, run to its longest output; the decode steps it took."""
    width = max(len(p) for p in work.prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in work.prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in work.prompts], device=model.device)
    longest = max(work.max_tokens)
    out = model.generate(
        ids,
        attention_mask=mask,
        generation_config=_generation_config(longest, pad),
        stopping_criteria=[counter] if counter else None,
    )
    if out.shape[1] - width != longest:
        raise RuntimeError(f"static generate made {out.shape[1] - width} tokens, {longest} asked")
    return longest


def run_hf_continuous(model_path: str, work: Workload, device: str, dtype: str, progress: Progress) -> dict[str, Any]:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = _hf_model(model_path, device, dtype)
    progress.phase("warming")
    config = _generation_config(max(work.max_tokens), 0)
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in work.prompts),
        max_generated_length=max(work.max_tokens),
        num_requests=len(work.prompts),
    )
    begin = time.perf_counter()
    with model.continuous_batching_context_manager(
        # (its warm-up captures CUDA graphs; on CPU, a dry run, there are none to capture)
        generation_config=config,
        workload_hints=hints,
        warmup=device == "cuda",
        block=True,
        timeout=10,
    ) as manager:
        warm_up = time.perf_counter() - begin  # its CUDA graphs captured: not timed, as ours
        _sync()
        progress.phase("generating")
        begin = time.perf_counter()
        for i, (prompt, m) in enumerate(zip(work.prompts, work.max_tokens, strict=True)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
        produced, done = 0, 0
        while done < len(work.prompts):
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(f"transformers' continuous batching stopped after {done} sequences")
                continue
            if out.is_finished():
                done += 1
                produced += len(out.generated_tokens)
                progress.done(done, produced)
        _sync()
        seconds = time.perf_counter() - begin
    if produced != work.output_tokens:
        raise RuntimeError(f"continuous batching produced {produced} tokens, {work.output_tokens} asked")
    result = _rate(produced, seconds, len(work.prompts))
    result.update(warm_up_s=round(warm_up, 1), attn_implementation=model.config._attn_implementation)
    return result


def _hf_model(path: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()  # type: ignore[arg-type]  # stubs lose .to's self


def _generation_config(max_new_tokens: int, pad: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=pad,
        bos_token_id=None,
    )


def _rate(tokens: int, seconds: float, sequences: int) -> dict[str, Any]:
    return {
        "sequences": sequences,
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "output_tok_s": tokens / seconds,
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
def child(args: argparse.Namespace) -> int:
    data = json.loads(Path(args.workload).read_text())
    work = Workload(data["prompts"], data["max_tokens"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    progress = Progress(Path(args.result).with_suffix(".progress.json"))
    if args.system == "engine":
        full = nano_vllm_workload(256) if device == "cuda" and not args.dry_run else None
        result = run_engine(args.model, work, device, dtype, full)
    elif args.system == "hf_static":
        result = run_hf_static(args.model, work, device, dtype, args.static_batch, progress)
    else:
        result = run_hf_continuous(args.model, work, device, dtype, progress)
    Path(args.result).write_text(json.dumps(result))
    return 0


def parent(args: argparse.Namespace) -> int:
    work_dir = args.work or Path(tempfile.gettempdir()) / "conveyor-throughput"
    work_dir.mkdir(parents=True, exist_ok=True)
    models = args.models or work_dir / "models"
    model = build_shaped_model(shaped_model_dir(models, SHAPE, dry_run=args.dry_run), SHAPE, dry_run=args.dry_run)
    num_seqs = args.num_seqs or (4 if args.dry_run else DEFAULT_SEQUENCES)
    if args.dry_run:
        work = nano_vllm_workload(num_seqs, lo=8, hi=24, max_token_id=DRY_RUN_SHAPE["vocab_size"] - 1)
    else:
        work = nano_vllm_workload(num_seqs)
    workload_file = work_dir / "throughput_workload.json"
    workload_file.write_text(json.dumps(asdict(work)))
    out = args.out or RESULTS / f"throughput_{gpu_tag() if torch.cuda.is_available() else 'cpu'}.json"
    report: dict[str, Any] = {
        "benchmark": "throughput",
        "workload": {
            "shape": SHAPE,
            "sequences": num_seqs,
            "prompt_tokens": sum(len(p) for p in work.prompts),
            "output_tokens": work.output_tokens,
            "lengths": "uniform 8..24 (dry run)" if args.dry_run else "prompt and output uniform in 100..1024",
            "temperature": TEMPERATURE,
        },
        "published": PUBLISHED,
        "machine": machine_info(),
        "systems": {},
    }
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped from outside: keep what finished
    try:
        for system in args.systems:
            report["systems"][system] = _run_child(system, args, model, workload_file, work_dir)
            _write(out, report)
    finally:
        _write(out, report)
    _print(report)
    return 0 if all("output_tok_s" in r for r in report["systems"].values()) else 1


def _run_child(system: str, args: argparse.Namespace, model: Path, workload: Path, work_dir: Path) -> dict[str, Any]:
    result_file = work_dir / f"throughput_{system}.json"
    progress_file = result_file.with_suffix(".progress.json")
    result_file.unlink(missing_ok=True)
    progress_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.bench_throughput", "--system", system, "--model", str(model)]
    cmd += ["--workload", str(workload), "--result", str(result_file), "--static-batch", str(args.static_batch)]
    cmd += ["--dry-run"] if args.dry_run else []
    print(f"\n--- {system}", flush=True)
    begin = time.monotonic()
    try:
        proc = subprocess.run(cmd, timeout=LIMITS_S[system], env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired:
        # Where it got to: a rate over the sequences it finished, and how long set-up took.
        partial = json.loads(progress_file.read_text()) if progress_file.exists() else None
        return {
            "error": f"over its {LIMITS_S[system]:.0f}s limit",
            "seconds": round(time.monotonic() - begin, 1),
            "partial": partial,
        }
    if proc.returncode != 0 or not result_file.exists():
        return {"error": f"exit status {proc.returncode} (the log has its traceback)"}
    return json.loads(result_file.read_text())


def _write(out: Path, report: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))


def _print(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(f"\n{w['sequences']} sequences, {w['output_tokens']} output tokens ({w['lengths']})")
    engine = report["systems"].get("engine", {}).get("output_tok_s")
    for name, r in report["systems"].items():
        if "output_tok_s" in r:
            ratio = f"  (ours {engine / r['output_tok_s']:.2f}x)" if engine and name != "engine" else ""
            print(f"  {name:<14} {r['output_tok_s']:9.0f} tok/s in {r['seconds']:.1f}s{ratio}")
        else:
            rate = (r.get("partial") or {}).get("output_tok_s")
            print(f"  {name:<14} {r['error']}" + (f"; {rate:.0f} tok/s over the sequences it finished" if rate else ""))
    full = report["systems"].get("engine", {}).get("nano_vllm_full")
    if full:
        print(f"  engine, nano-vllm's 256 sequences: {full['output_tok_s']:.0f} tok/s")
    for p in report["published"]:
        print(f"  published: {p['system']} on {p['gpu']}: {p['output_tok_s']} tok/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="the workload file and the children's results")
    ap.add_argument("--models", type=Path, default=None, help="where the shaped checkpoint is built (or found)")
    ap.add_argument(
        "--num-seqs", type=int, default=None, help=f"sequences (default {DEFAULT_SEQUENCES}; 4 in a dry run)"
    )
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--static-batch", type=int, default=DEFAULT_SEQUENCES, help="sequences per static batch")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model and lengths: checks the script")
    ap.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)  # a child: run one system
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    return child(args) if args.system else parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
