"""``conveyor``: run | submit | worker | serve | keys | webhooks | status | results | cancel | db upgrade | bench.

One module per command group adds its parser (``add_parser``) and holds its command; this
package assembles them (``build_parser``) and runs one (``main``).

User errors (a missing file, a bad setting, an unknown job, a service that cannot be
reached) print one line, ``conveyor: error: ...``, and exit 1; URLs are shown redacted.

The commands that drive the engine (``run``, ``worker``, ``bench``) import it when they run:
torch takes seconds to import, and ``submit``, ``status`` or ``results`` never need it.
``serve`` imports the HTTP stack (FastAPI, uvicorn) when it runs, for the same reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

from conveyor.worker.core.terminal_text import printable
from conveyor.worker.entrypoints.cli import bench, db, jobs, keys, results, run, serve, submit, webhooks, worker
from conveyor.worker.entrypoints.cli.errors import EXIT_ERROR, EXIT_INTERRUPTED, describe, user_error_types
from conveyor.worker.entrypoints.cli.extra import missing_extra


def _version() -> str:
    try:
        return version("conveyor")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conveyor",
        description="Queue-driven batch inference for LLMs. Configuration: CONVEYOR_* environment variables "
        "(the docs' settings reference); with none set, everything lives under CONVEYOR_HOME (~/.conveyor).",
    )
    p.add_argument("--version", action="version", version=f"conveyor {_version()}")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run.add_parser(sub)
    submit.add_parser(sub)
    worker.add_parser(sub)
    jobs.add_jobs_parser(sub)
    jobs.add_status_parser(sub)
    results.add_parser(sub)
    jobs.add_cancel_parser(sub)
    jobs.add_retry_parser(sub)
    bench.add_parser(sub)
    serve.add_parser(sub)
    keys.add_parser(sub)
    webhooks.add_parser(sub)
    db.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (missing := missing_extra()) is not None:
        command = " ".join(
            str(getattr(args, key)) for key in ("command", "keys_command", "db_command") if getattr(args, key, None)
        )
        print(
            f"conveyor: error: 'conveyor {command}' needs the worker extra ({missing} is not installed): "
            "pip install 'conveyor[worker]'",
            file=sys.stderr,
        )
        return EXIT_ERROR
    logging.basicConfig(
        level=os.environ.get("CONVEYOR_LOG_LEVEL", "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    fn: Callable[[argparse.Namespace], int] = args.fn
    try:
        return fn(args)
    except KeyboardInterrupt:
        print("conveyor: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except Exception as exc:
        if args.debug or not isinstance(exc, user_error_types()):
            if not args.debug:
                what = printable(str(exc))
                print(
                    f"conveyor: internal error: {type(exc).__name__}: {what} (run with --debug for details)",
                    file=sys.stderr,
                )
                return EXIT_ERROR
            raise
        print(f"conveyor: error: {printable(describe(exc))}", file=sys.stderr)
        return EXIT_ERROR
