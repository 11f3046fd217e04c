"""The commands on jobs already submitted: ``jobs`` (the list), ``status``, ``cancel``, ``retry``.
(``results`` has a module of its own.)"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from conveyor.worker.entrypoints.cli.common import open_client, waiting_note, where
from conveyor.worker.entrypoints.cli.errors import UserError
from conveyor.worker.entrypoints.cli.extra import worker_extra
from conveyor.worker.entrypoints.cli.formatting import print_json, show, summary
from conveyor.worker.entrypoints.cli.options import JOB_STATUSES, add_job, add_json, non_negative_int

with worker_extra():
    from conveyor.worker.jobs.lifecycle import JobNotFound


def add_jobs_parser(sub: Any) -> None:
    jobs = sub.add_parser("jobs", help="list jobs, newest first")
    jobs.add_argument("--status", action="append", choices=JOB_STATUSES, help="only jobs in this status (repeatable)")
    jobs.add_argument("--limit", type=non_negative_int, default=20, help="at most this many (default 20, up to 1000)")
    jobs.add_argument("--after", help="only jobs created before this job id (to page on)")
    add_json(jobs, help="print an OpenAI-style list of batch objects")
    jobs.set_defaults(fn=cmd_jobs)


def add_status_parser(sub: Any) -> None:
    status = sub.add_parser("status", help="show a job")
    add_job(status)
    add_json(status)
    status.set_defaults(fn=cmd_status)


def add_cancel_parser(sub: Any) -> None:
    cancel = sub.add_parser("cancel", help="cancel a job (results so far are kept)")
    add_job(cancel)
    add_json(cancel)
    cancel.set_defaults(fn=cmd_cancel)


def add_retry_parser(sub: Any) -> None:
    retry = sub.add_parser("retry", help="enqueue again a job whose shards could not be enqueued at submit")
    add_job(retry)
    add_json(retry)
    retry.set_defaults(fn=cmd_retry)


def cmd_jobs(args: argparse.Namespace) -> int:
    with open_client() as client:
        jobs = client.jobs(args.status or (), limit=args.limit, after=args.after)
        if not jobs and not args.json:
            print(f"conveyor: no jobs{' in that status' if args.status else ''} in {where(client.settings)}",
                  file=sys.stderr)  # fmt: skip
    if args.json:
        print_json({"object": "list", "data": jobs, "has_more": len(jobs) == args.limit})
        return 0
    for job in jobs:
        c = job["request_counts"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["created_at"]))
        print(
            f"{job['id']}  {job['status']:<11}  {c['completed']}/{c['failed']}/{c['total']} done/failed/total  "
            f"{created}  {job['model']}"
        )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with open_client() as client:
        try:
            job = client.status(args.job)
        except JobNotFound as exc:
            raise JobNotFound(f"{exc} in {where(client.settings)}") from None
        service, note = waiting_note(client, job)
    if args.json:
        if service is not None:  # an extra field beside OpenAI's: who serves the job's model
            job["serving"] = {**service.as_dict(), "note": note}
        print_json(job)
    else:
        print(summary(job) + (f"\n{note}" if note else ""))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with open_client() as client:
        status = client.status(args.job)["status"]
        if status in ("completed", "failed", "expired"):
            raise UserError(f"job {args.job} already {status}: there is nothing to cancel")
        job = client.cancel(args.job)  # a cancelled job stays so: cancelling is idempotent
    show(job, args.json)
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    with open_client() as client:
        job = client.retry(args.job)
    show(job, args.json)
    return 0
