"""``conveyor submit``: validate and enqueue a job."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from conveyor.worker.entrypoints.cli.common import open_client
from conveyor.worker.entrypoints.cli.errors import EXIT_ERROR, UserError
from conveyor.worker.entrypoints.cli.extra import worker_extra
from conveyor.worker.entrypoints.cli.formatting import no_success_reason, print_json, summary
from conveyor.worker.entrypoints.cli.options import (
    MODEL_HELP,
    add_input_and_model,
    add_json,
    add_shard_options,
    non_negative_int,
)
from conveyor.worker.entrypoints.request_flags import add_request_flags, request_options

with worker_extra():
    from conveyor.worker.jobs.catalog import is_declared
    from conveyor.worker.jobs.model_names import canonical_model
    from conveyor.worker.jobs.servable import unserved_refusal
    from conveyor.worker.store.models import JobStatus


def add_parser(sub: Any) -> None:
    submit = sub.add_parser("submit", help="validate and enqueue a job; prints its id")
    add_input_and_model(submit, MODEL_HELP + "; workers serving it must run")
    add_shard_options(submit)
    submit.add_argument("--priority", type=non_negative_int, help="lower runs first under the priority policy (0)")
    submit.add_argument(
        "--completion-window", help="e.g. 24h, 1h, 7d (up to 30d; default CONVEYOR_COMPLETION_WINDOW, 24h)"
    )
    submit.add_argument(
        "--allow-unserved", action="store_true",
        help="submit even when neither CONVEYOR_MODELS nor a live worker names the model (it waits for a worker)",
    )  # fmt: skip
    add_json(submit)
    add_request_flags(submit)
    submit.set_defaults(fn=cmd_submit)


def cmd_submit(args: argparse.Namespace) -> int:
    with open_client() as client:
        if not args.allow_unserved:
            refusal = unserved_refusal(client.db, client.settings, canonical_model(args.model))
            if refusal is not None:
                raise UserError(f"{refusal} (--allow-unserved submits the job anyway)")
        job = client.submit(
            args.input,
            args.model,
            args.shard_size,
            args.priority,
            input_format=args.format,
            completion_window=args.completion_window,
            shard_order=args.shard_order,
            **request_options(args),
        )
        live = JobStatus(job["status"]).terminal or client.model_service(job["model"]).live
        declared = is_declared(client.settings, job["model"])
    if not live and not declared:  # the job stays queued: a worker may start later
        model = job["model"]
        print(
            f"conveyor: warning: no live worker serves model {model}; start one with: conveyor worker --model {model}",
            file=sys.stderr,
        )
    return report_submitted(job, args.json)


def report_submitted(job: dict[str, Any], as_json: bool) -> int:
    """Print the new job (its id, or the whole object with ``--json``); the exit code."""
    if as_json:
        print_json(job)
    elif job["status"] == "failed":
        print(summary(job), file=sys.stderr)
    else:
        print(job["id"])
    if job["status"] == "failed":
        return EXIT_ERROR
    # Completed at submission: every line was rejected, nothing will run.
    why = no_success_reason(job, f"`conveyor results {job['id']} --errors`") if job["status"] == "completed" else None
    if why is not None:
        print(f"conveyor: error: no request succeeded: {why}", file=sys.stderr)
        return EXIT_ERROR
    return 0
