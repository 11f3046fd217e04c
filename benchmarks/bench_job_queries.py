"""The job path's database work on a job of many stored items, without running one: a job of
``--items`` items (in shards of ``--shard-size``) seeded straight into a PostgreSQL database,
then the queries that run per shard, per status call and once at finalisation, each timed.
What grows with the job shows here in seconds rather than in an hour-long run.

    PYTHONPATH=. python benchmarks/bench_job_queries.py --items 1000000 \\
        --url postgresql://postgres@127.0.0.1:5432/conveyor_bench

The database's tables are dropped and created again: give it one of its own. Writes
``benchmarks/results/job_queries.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from benchmarks.common import write_results
from conveyor.worker.store.database import create_db_engine, make_sessionmaker
from conveyor.worker.store.item_totals import item_totals
from conveyor.worker.store.items import record_shard_counts, refresh_job_counts, summarize_job
from conveyor.worker.store.models import Base, Job, JobStatus

JOB = "batch_bench"


def seed(db: Any, items: int, shard_size: int) -> int:
    """The job, its shards and its succeeded items, as ``bench_million.py``'s lines store them."""
    shards = -(-items // shard_size)
    Base.metadata.drop_all(db)
    Base.metadata.create_all(db)
    with make_sessionmaker(db).begin() as session:
        session.add(
            Job(id=JOB, model="m", shard_size=shard_size, status=JobStatus.in_progress, total_requests=items,
                num_shards=shards)
        )  # fmt: skip
    with db.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO shards (job_id, shard_index, first_line, last_line, num_items, status, attempts,"
                " failures, deaths, succeeded_items, failed_items, created_at)"
                " SELECT :job, g, g * :size + 1, (g + 1) * :size, :size, 'running', 1, 0, 0, 0, 0, 0"
                " FROM generate_series(0, :shards - 1) g"
            ),
            {"job": JOB, "size": shard_size, "shards": shards},
        )
        conn.execute(
            text(
                "INSERT INTO items (job_id, custom_id, shard_index, line, status, status_code, response,"
                " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, preemptions, queue_time, ttft,"
                " tpot, e2e, finished_at)"
                " SELECT :job, 'req-' || g, (g - 1) / :size, g, 'succeeded', 200,"
                ' \'{"choices": [{"message": {"role": "assistant", "content": "x"}}]}\'::json,'
                " 10, 0, 1, 0, 0, random(), random(), random(), random(), g FROM generate_series(1, :items) g"
            ),
            {"job": JOB, "size": shard_size, "items": items},
        )
        conn.execute(text("ANALYZE items"))
    return shards


def timed(fn: Callable[[], object], repeat: int) -> float:
    """The median seconds of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.monotonic()
        fn()
        times.append(time.monotonic() - start)
    return round(sorted(times)[len(times) // 2], 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--shard-size", type=int, default=2000)
    parser.add_argument("--url", required=True, help="a PostgreSQL database of its own (its tables are replaced)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="job_queries.json")
    args = parser.parse_args()
    db = create_db_engine(args.url)
    start = time.monotonic()
    shards = seed(db, args.items, args.shard_size)
    print(f"seeded {args.items} items in {shards} shards in {time.monotonic() - start:.1f} s")
    seconds = {
        # per shard release: what the worker runs now, and the job-wide recount it ran before
        "shard_release_counts": timed(lambda: record_shard_counts(db, JOB, shards // 2), args.repeat),
        "job_wide_recount": timed(lambda: refresh_job_counts(db, JOB), args.repeat),
        # per status call on a live job
        "status_item_totals": timed(lambda: item_totals(db, JOB, 0.0), args.repeat),
        # once, at finalisation
        "finalise_summary": timed(lambda: summarize_job(db, JOB), 1),
    }
    for name, value in seconds.items():
        print(f"  {name:22s} {value:8.3f} s")
    load = os.getloadavg()[0]
    db.dispose()
    write_results(
        args.out,
        {"args": {k: v for k, v in vars(args).items() if k != "url"}, "shards": shards, "seconds": seconds,
         "load_average_1m": round(load, 1), "note": "a shared 2-core machine"},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
