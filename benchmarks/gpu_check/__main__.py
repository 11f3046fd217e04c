"""``python -m benchmarks.gpu_check --out DIR [--dry-run]``: see the package's docstring."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_check.environment import describe
from benchmarks.gpu_check.runner import CheckRun
from benchmarks.gpu_check.steps import DRY_RUN_SLACK, plan

# The whole run, start to end, on a GPU: a 15-minute loan holds a machine start, this run
# and a second, shorter call for what it found.
BUDGET_S = 540.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    ap.add_argument(
        "--out", required=True, type=Path, help="directory for gpu_check.json, the log and each step's JSON"
    )
    ap.add_argument("--work", type=Path, default=None, help="models and compile caches (default: a temp directory)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton's interpreter")
    ap.add_argument("--budget", type=float, default=None, help=f"seconds for the whole run (default {BUDGET_S:.0f})")
    ap.add_argument("--only", nargs="+", default=None, help="run only these steps (a second, shorter call)")
    ap.add_argument("--commit", default=None, help="the commit under test, recorded with the results")
    args = ap.parse_args(argv)

    import torch

    # (is_available asks the driver without making a context, which would hold GPU memory)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.gettempdir()) / "conveyor-gpu-check"
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Every step compiles into one Triton cache: a kernel variant compiled once serves them all.
    env.setdefault("TRITON_CACHE_DIR", str(work / "triton-cache"))
    env["CONVEYOR_SHAPED_MODELS"] = str(work / "models")
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
        env["CONVEYOR_GPU_CHECK_DRY_RUN"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env["CONVEYOR_TEST_GPU"] = "1"
        env.pop("TRITON_INTERPRET", None)

    steps = plan(args.out, work, dry_run=args.dry_run)
    unknown = set(args.only or ()) - {s.name for s in steps}
    if unknown:
        ap.error(f"unknown steps {sorted(unknown)}; the steps are {[s.name for s in steps]}")
    if args.budget is None:
        args.budget = BUDGET_S * (DRY_RUN_SLACK if args.dry_run else 1)
    summary = {"dry_run": args.dry_run, "budget_s": args.budget, "environment": describe(args.commit)}
    run = CheckRun(args.out, args.budget, env, summary)
    begin = time.monotonic()
    run.say(json.dumps(summary["environment"], indent=2))
    try:
        for step in steps:
            if args.only is None or step.name in args.only:
                run.run(step)
    finally:
        summary["seconds"] = round(time.monotonic() - begin, 1)
        run.write_summary()
        run.say(f"\n{'step':<12} {'status':<8} {'seconds':>8}")
        for s in summary["steps"]:
            run.say(f"{s['name']:<12} {s['status']:<8} {s['seconds']:>8.0f}")
        run.say(f"total {summary['seconds']:.0f}s; results in {args.out}")
        run.close()
    return 0 if all(s["status"] == "ok" for s in summary["steps"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
