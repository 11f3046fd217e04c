"""The chaos soak: a job of many short lines on private PostgreSQL, Redis and S3 (moto) instances,
up to three workers started and stopped by a KEDA-like autoscaler, and a random fault every 10 to
30 s for ``--minutes``: a worker SIGKILLed, a worker stopped as a spot node is (SIGTERM, drain,
SIGKILL after the grace period), Redis restarted empty, PostgreSQL stopped and started, the object
store refusing connections for up to 60 s, the API server killed. A fault-free run of the same job
first gives the baseline. Nothing touches the machine's shared services.

Writes ``benchmarks/results/faults.json`` (per fault kind: count, recovery time; the items lost
and duplicated, the tokens computed twice, the slowdown) and ``faults.png``.

    PYTHONPATH=. python benchmarks/bench_faults.py --lines 50000 --minutes 10
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, bench_model, write_results
from tests.worker.chaos import FAULTS, ChaosDeployment, ChaosRun, run_job_under_faults


def _run(model: str, args: argparse.Namespace, *, faults: bool) -> ChaosRun:
    with tempfile.TemporaryDirectory(prefix="conveyor-faults-") as tmp:
        dep = ChaosDeployment(
            Path(tmp), model, max_workers=args.workers, concurrency=args.concurrency,
            engine_args={"num_kv_blocks": 1024, "max_num_seqs": 64},
            lease_seconds=10.0, heartbeat_seconds=2.0, sweep_interval_seconds=2.0, item_commit_interval_seconds=0.5,
        )  # fmt: skip
        dep.rng.seed(args.seed)
        try:
            return run_job_under_faults(
                dep, args.lines, shard_size=args.shard_size, max_tokens=args.max_tokens,
                schedule=None if faults else [],
                interval_s=(args.min_interval, args.max_interval), duration_s=args.minutes * 60,
                max_outage_s=args.max_outage, timeout_s=args.timeout_minutes * 60,
            )  # fmt: skip
        finally:
            dep.close()


def _per_kind(run: ChaosRun) -> dict[str, Any]:
    kinds: dict[str, Any] = {}
    for kind in FAULTS:
        records = [f.as_dict(run.t0) for f in run.faults if f.kind == kind]
        recoveries = [r["recovery_s"] for r in records if r["recovery_s"] is not None]
        twice = [r["tokens_computed_twice"] for r in records if r["tokens_computed_twice"] is not None]
        kinds[kind] = {
            "count": len(records),
            "recovery_s_median": round(statistics.median(recoveries), 2) if recoveries else None,
            "recovery_s_max": max(recoveries) if recoveries else None,
            "outage_s_median": round(statistics.median(r["outage_s"] for r in records), 2) if records else None,
            "tokens_computed_twice": round(sum(twice), 1) if twice else None,
        }
    return kinds


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in FAULTS if result["per_kind"][k]["count"]]
    values = [result["per_kind"][k]["recovery_s_median"] or 0 for k in kinds]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(kinds, values)
    ax.set_ylabel("median recovery (s): fault over -> items stored again")
    chaos = result["chaos"]
    ax.set_title(
        f"{chaos['lines']} lines, {len(chaos['faults'])} faults: lost {chaos['lost']}, "
        f"duplicated {chaos['duplicated']}, slowdown x{result['slowdown']}"
    )
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected")
    parser.add_argument("--workers", type=int, default=3, help="the autoscaler's maximum")
    parser.add_argument("--concurrency", type=int, default=2, help="shards per worker")
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=2, help="per line: longer makes the job last longer")
    parser.add_argument("--min-interval", type=float, default=10.0)
    parser.add_argument("--max-interval", type=float, default=30.0)
    parser.add_argument("--max-outage", type=float, default=60.0, help="the longest object-store outage (s)")
    parser.add_argument("--timeout-minutes", type=float, default=60.0, help="the bound the job must finish in")
    parser.add_argument("--seed", type=int, default=0, help="the faults' order, timing and targets")
    parser.add_argument("--out", default="faults.json")
    args = parser.parse_args()
    model = str(bench_model())

    print(f"fault-free run of {args.lines} lines")
    baseline = _run(model, args, faults=False)
    print(f"  {baseline.seconds:.1f} s, {args.lines / baseline.seconds:.0f} items/s")
    print(f"run of {args.lines} lines with a fault every {args.min_interval:g}-{args.max_interval:g} s")
    chaos = _run(model, args, faults=True)
    print(f"  {chaos.seconds:.1f} s, {len(chaos.faults)} faults, exactly once: {chaos.exactly_once}")
    result: dict[str, Any] = {
        "args": vars(args),
        "baseline": baseline.as_dict(),
        "chaos": chaos.as_dict(),
        "per_kind": _per_kind(chaos),
        "slowdown": round(chaos.seconds / baseline.seconds, 2),
        "exactly_once": chaos.exactly_once and baseline.exactly_once,
        "note": "tokens computed twice: the workers' conveyor_engine_generated_tokens_total (a worker about to be "
        "stopped scraped just before) less the stored items' completion tokens; per fault, its growth from the "
        "fault's start to the next fault's (each reading also holds the items finished and not committed yet, "
        "at most item_commit_interval_seconds of work); a shared 2-core machine",
    }
    out = write_results(args.out, result)
    _plot(result, RESULTS / Path(args.out).with_suffix(".png").name)
    for kind, figures in result["per_kind"].items():
        print(f"  {kind:18s} {figures}")
    print(f"tokens computed twice: {chaos.as_dict()['tokens_computed_twice']} of {chaos.tokens_stored} stored")
    print(f"slowdown x{result['slowdown']}; lost {chaos.lost}, duplicated {chaos.duplicated}; {out}")
    return 0 if result["exactly_once"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
