"""``conveyor run``: a whole job in this process, no broker needed."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from conveyor.worker.entrypoints.cli.common import checked_engine_overrides, load_settings
from conveyor.worker.entrypoints.cli.errors import EXIT_ERROR, EXIT_INTERRUPTED
from conveyor.worker.entrypoints.cli.extra import worker_extra
from conveyor.worker.entrypoints.cli.formatting import no_success_reason, run_summary
from conveyor.worker.entrypoints.cli.options import (
    MODEL_HELP,
    add_concurrency,
    add_input_and_model,
    add_shard_options,
    non_negative_int,
)
from conveyor.worker.entrypoints.cli.output import write_lines
from conveyor.worker.entrypoints.engine_flags import add_engine_flags
from conveyor.worker.entrypoints.request_flags import add_request_flags, request_options

with worker_extra():
    from conveyor.worker.batchio.error_summary import summarize_failures
    from conveyor.worker.core.settings import Settings
    from conveyor.worker.entrypoints.client import Client
    from conveyor.worker.entrypoints.progress_bar import RunProgress


def add_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="run a whole job in this process (no broker needed)")
    add_input_and_model(run, MODEL_HELP)
    run.add_argument("-o", "--output", help="write the results file here (default: stdout)")
    run.add_argument("--errors", help="write the errors file here")
    add_shard_options(run)
    run.add_argument("--priority", type=non_negative_int, help="the job's priority: lower runs first (default 0)")
    add_concurrency(run, "shards run")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_request_flags(run)
    add_engine_flags(run)
    run.set_defaults(fn=cmd_run)


class RunReport:
    """What ``conveyor run`` says on stderr while its job loads and runs (nothing with ``--quiet``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.bar = RunProgress()
        self.started: list[dict[str, Any]] = []

    def on_start(self, job: dict[str, Any]) -> None:
        self.started.append(job)
        counts = job["request_counts"]
        if not self.args.quiet:
            self.bar.start(counts["total"], counts["failed"])

    def on_loading(self) -> None:
        if not self.args.quiet:
            print(f"conveyor: loading model {self.args.model} ...", file=sys.stderr, flush=True)

    def on_loaded(self, seconds: float, has_template: bool) -> None:
        if self.args.quiet:
            return
        chat = {True: "on", False: "off"}.get(
            self.args.chat, "on (auto)" if has_template else "off (auto: the model has no chat template)"
        )
        print(f"conveyor: model loaded in {seconds:.1f} s; chat template for prompt rows: {chat}", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    from conveyor.worker.entrypoints.local_runner import run_job  # the engine (see the package docstring)

    began = time.monotonic()
    settings = load_settings(worker_concurrency=args.concurrency, **checked_engine_overrides(args))
    report = RunReport(args)
    try:
        job = run_job(
            settings, args.input, args.model, shard_size=args.shard_size, priority=args.priority,
            input_format=args.format, shard_order=args.shard_order, on_start=report.on_start,
            on_records=report.bar.add, submit_options=request_options(args), on_loading=report.on_loading,
            on_loaded=report.on_loaded,
        )  # fmt: skip
    except KeyboardInterrupt as exc:
        job_id = getattr(exc, "job_id", None) or (report.started[0]["id"] if report.started else None)
        if job_id is None:
            raise
        print_interrupted(job_id, settings)  # run_job cancelled it; what finished is kept
        return EXIT_INTERRUPTED
    finally:
        report.bar.close()
    kinds_failed = save_outputs(settings, job, args)
    print(run_summary(job, time.monotonic() - began, args.output, args.errors), file=sys.stderr)
    if kinds_failed:
        print(f"conveyor: why they failed: {'; '.join(kinds_failed)}", file=sys.stderr)
    why = no_success_reason(job, args.errors or "the errors file (--errors FILE writes it)")
    if why is not None:
        print(f"conveyor: error: no request succeeded: {why}", file=sys.stderr)
        return EXIT_ERROR
    return 0 if job["status"] == "completed" else EXIT_ERROR


def print_interrupted(job_id: str, settings: Settings) -> None:
    print(
        f"\nconveyor: interrupted: job {job_id} is cancelled and keeps the requests it finished; "
        f"get them with: conveyor results {job_id} -o results.jsonl (and --errors for the errors "
        f"file), with the same CONVEYOR_HOME ({settings.home_dir})",
        file=sys.stderr,
    )


def save_outputs(settings: Settings, job: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Write the job's results (and errors, with ``--errors``) where asked; the kinds of its
    failures, described (empty when none failed)."""
    if job["status"] == "failed":
        return []
    client = Client(settings)
    try:
        write_lines(client.result_bytes(job["id"]), args.output)
        if args.errors:
            write_lines(client.result_bytes(job["id"], errors=True), args.errors)
        if not job["request_counts"]["failed"]:
            return []
        kinds, others = summarize_failures(client.result_bytes(job["id"], errors=True))
        return [k.describe() for k in kinds] + ([f"{others} other kinds"] if others else [])
    finally:
        client.close()
