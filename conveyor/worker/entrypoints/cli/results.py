"""``conveyor results``: a job's results or errors file, its unfinished input, or its results
as Parquet; ``--follow`` streams a running job's lines as they are stored."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from typing import Any

from conveyor.worker.entrypoints.cli.common import open_client, waiting_note
from conveyor.worker.entrypoints.cli.errors import UserError
from conveyor.worker.entrypoints.cli.extra import worker_extra
from conveyor.worker.entrypoints.cli.formatting import progress_text
from conveyor.worker.entrypoints.cli.options import add_job
from conveyor.worker.entrypoints.cli.output import write_lines

with worker_extra():
    from conveyor.worker.entrypoints.client import Client
    from conveyor.worker.jobs.live_lines import FollowState

FOLLOW_REPORT_SECONDS = 2.0


def add_parser(sub: Any) -> None:
    results = sub.add_parser("results", help="print (or save) a job's results or errors file")
    add_job(results)
    results.add_argument("-o", "--output", help="write here instead of stdout")
    results.add_argument("--errors", action="store_true", help="the errors file instead")
    results.add_argument(
        "--format",
        choices=("jsonl", "parquet"),
        default="jsonl",
        help="jsonl (the file as it is) or parquet (needs -o): an embeddings job's vectors (custom_id, index, "
        "embedding as fixed-size float32 lists), or one row per answer (custom_id, status, text, reasoning, "
        "tool_calls, finish_reason, token counts, error)",
    )
    results.add_argument(
        "--follow", action="store_true",
        help="stream a running job's results as each line is stored (to -o FILE as they come), with its progress "
        "on stderr",
    )  # fmt: skip
    results.add_argument(
        "--order", choices=("input", "completion"), default="input",
        help="with --follow: input (default: the file's order, each line once those before it are stored) or "
        "completion (each line as it is stored)",
    )  # fmt: skip
    results.add_argument(
        "--unfinished", action="store_true",
        help="a cancelled or expired job's input lines that never ran, as submitted (a CSV keeps its header): "
        "submit them again to finish the job",
    )  # fmt: skip
    results.set_defaults(fn=cmd_results)


def cmd_results(args: argparse.Namespace) -> int:
    if args.unfinished:
        return write_unfinished(args)
    with open_client() as client:
        report = FollowReport(client, args.job)
        lines = client.result_bytes(args.job, errors=args.errors, follow=args.follow, order=args.order, on_wait=report)
        if args.format == "parquet":
            return write_parquet(lines, args)
        write_lines(lines, args.output, live=args.follow)
    return 0


class FollowReport:
    """While following, say on stderr how far the job is (every couple of seconds)."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.job_id = job_id
        self.last = -FOLLOW_REPORT_SECONDS

    def __call__(self, state: FollowState) -> None:
        if time.monotonic() - self.last < FOLLOW_REPORT_SECONDS:
            return
        self.last = time.monotonic()
        job = self.client.status(self.job_id)
        if not state.num_shards:
            print(f"conveyor: waiting for the job's intake ({job['status']})", file=sys.stderr, flush=True)
        else:
            text = progress_text(job) or job["status"]
            print(f"conveyor: {state.written} lines written; {text}", file=sys.stderr, flush=True)
        if (note := waiting_note(self.client, job)[1]) is not None:
            print(f"conveyor: {note}", file=sys.stderr, flush=True)


def write_unfinished(args: argparse.Namespace) -> int:
    if args.errors or args.follow or args.format != "jsonl":
        raise UserError(
            "--unfinished writes the input lines that never ran, as submitted: no --errors, --follow or --format"
        )
    with open_client() as client:
        count = write_lines(client.unfinished_bytes(args.job), args.output)
    if args.output not in (None, "-"):
        print(f"conveyor: wrote the unfinished input of {args.job} to {args.output} ({count} lines)", file=sys.stderr)
    return 0


def write_parquet(lines: Iterable[bytes], args: argparse.Namespace) -> int:
    from conveyor.worker.batchio.answers_parquet import NotAnswers
    from conveyor.worker.batchio.embeddings_parquet import NotEmbeddings
    from conveyor.worker.batchio.results_parquet import write_results_parquet

    if args.output is None:
        raise UserError("--format parquet writes to a file: give -o FILE")
    try:
        export = write_results_parquet(lines, args.output)
    except (NotEmbeddings, NotAnswers) as exc:
        raise UserError(f"cannot export as Parquet: {exc}") from None
    print(f"conveyor: wrote {export.rows} {export.what} to {args.output}", file=sys.stderr)
    return 0
