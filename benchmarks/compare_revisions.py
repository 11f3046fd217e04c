"""``bench_continuous_batching``'s engine runs, side by side: a base revision (its files
exported with ``git archive`` into a temporary directory) against this tree, in one run on
the same machine, alternating which goes first each round, so drift in the machine's load
hits both alike.

Each round starts one fresh process per tree (PYTHONPATH and working directory that tree's),
which builds ``LLM`` on the benchmark's model and times the benchmark's two workloads (mixed
output lengths, and uniform ones) through ``benchmarks.bench_continuous_batching.run_engine``
after a warm-up; only the engine is timed (transformers' baselines are the same library on
both sides). Prints each side's fastest and median tokens/s per workload and the ratio, and
writes JSON to benchmarks/results/.

    python -m benchmarks.compare_revisions --base 515c7f8 [--size tiny] [--requests 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("engine_mixed", "engine_uniform")


def child(size: str, requests: int, max_output: int, uniform: int, cpu_threads: int | None) -> None:
    """One timed run in this process, against whichever tree PYTHONPATH names; JSON on stdout."""
    from benchmarks.bench_continuous_batching import SIZES, run_engine, workload
    from benchmarks.common import bench_model
    from conveyor.engine import LLM

    model_dir = bench_model(**SIZES[size])
    llm = LLM(str(model_dir), dtype="float32", device="cpu", cpu_threads=cpu_threads)
    vocab = llm.engine.vocab_size
    warm_p, warm_l = workload(8, 99, 4, 8, vocab)
    run_engine(llm, warm_p, warm_l)
    mixed_p, mixed_l = workload(requests, 0, 10, max_output, vocab)
    uni_p, _ = workload(requests, 1, 1, 1, vocab)
    result = {
        "engine_mixed": run_engine(llm, mixed_p, mixed_l),
        "engine_uniform": run_engine(llm, uni_p, [uniform] * requests),
        "num_steps": llm.engine.stats().num_steps,
    }
    print("RESULT " + json.dumps(result))


def run_side(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        f"--size={args.size}",
        f"--requests={args.requests}",
        f"--max-output={args.max_output}",
        f"--uniform-tokens={args.uniform_tokens}",
        *([f"--cpu-threads={args.cpu_threads}"] if args.cpu_threads else []),
    ]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the run in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in WORKLOADS:
        rates = [r[name]["tokens_per_s"] for r in runs]
        out[name] = {"fastest_tokens_per_s": max(rates), "median_tokens_per_s": statistics.median(rates), "all": rates}
    out["num_steps"] = runs[-1]["num_steps"]
    return out


# What a side needs to run: the package (one ``conveyor`` since the namespace move; the three
# top-level packages before it) and the benchmarks.
CODE_PATHS = ("conveyor", "engine", "kernels", "benchmarks")


def _code_paths(rev: str) -> list[str]:
    """Those of ``CODE_PATHS`` that exist at ``rev``."""
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, *CODE_PATHS], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return listed.stdout.split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="515c7f8", help="the revision to compare against")
    ap.add_argument("--size", default="tiny", help="bench_continuous_batching's model size")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=200, help="the mixed workload's longest output")
    ap.add_argument("--uniform-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--cpu-threads", type=int, help="fixed torch threads (default: the engine's own choice, tuned per step on CPU)"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.size, args.requests, args.max_output, args.uniform_tokens, args.cpu_threads)
        return

    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    head_rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain", "conveyor"], cwd=ROOT, capture_output=True, text=True)
    dirty = bool(status.stdout)
    with tempfile.TemporaryDirectory(prefix="conveyor-base-") as tmp:
        base_tree = Path(tmp)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", args.base, *_code_paths(args.base)],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive, check=True)
        runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
        for i in range(args.rounds):
            order = [("base", base_tree), ("head", ROOT)]
            for side, tree in order if i % 2 == 0 else order[::-1]:
                runs[side].append(run_side(tree, args))
                r = runs[side][-1]
                print(
                    f"round {i + 1} {side}: mixed {r['engine_mixed']['tokens_per_s']:.0f} tok/s, "
                    f"uniform {r['engine_uniform']['tokens_per_s']:.0f} tok/s",
                    flush=True,
                )

    from benchmarks.common import write_results

    result: dict[str, Any] = {
        "base": {"revision": base_rev, **summary(runs["base"])},
        "head": {"revision": head_rev + ("+dirty" if dirty else ""), **summary(runs["head"])},
        "settings": {k: v for k, v in vars(args).items() if k != "child"},
    }
    print(f"\n{'':18s}{'base ' + base_rev:>22s}{'head ' + head_rev:>22s}{'head/base':>11s}")
    for name in WORKLOADS:
        for stat in ("fastest_tokens_per_s", "median_tokens_per_s"):
            b, h = result["base"][name][stat], result["head"][name][stat]
            result.setdefault("ratio", {})[f"{name}_{stat}"] = h / b
            print(f"{name[7:] + ' ' + stat.split('_')[0]:18s}{b:22.0f}{h:22.0f}{h / b:11.3f}")
    threads = f"_threads{args.cpu_threads}" if args.cpu_threads else ""
    write_results(f"compare_revisions_{args.size}{threads}.json", result)


if __name__ == "__main__":
    main()
