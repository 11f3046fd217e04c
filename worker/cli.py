"""``conveyor``: run | submit | worker | status | results | cancel | db upgrade | bench.

User errors (a missing file, a bad setting, an unknown job, a service that cannot be
reached) print one line, ``conveyor: error: ...``, and exit 1; URLs are shown redacted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from worker.settings import Settings, redact_url

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """An error to show as one line, without a traceback."""


# ---- helpers ---------------------------------------------------------------------------


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment; ``overrides`` (command-line values) win and are
    validated like the rest."""
    from pydantic import ValidationError

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"CONVEYOR_{'_'.join(str(p) for p in e['loc']).upper() or '?'}: {e['msg']}" for e in exc.errors()
        )
        raise UserError(f"invalid settings: {problems}") from None


def _client(settings: Settings | None = None):
    from worker.client import Client

    return Client(settings or load_settings())


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


def _summary(job: dict[str, Any]) -> str:
    c = job["request_counts"]
    parts = [f"{job['id']}  {job['status']}", f"{c['completed']} completed, {c['failed']} failed of {c['total']}"]
    if job.get("output_uri"):
        parts.append(f"results: {job['output_uri']}")
    if job.get("error_uri") and c["failed"]:
        parts.append(f"errors: {job['error_uri']}")
    if job.get("errors"):
        parts.append("; ".join(e.get("message", "") for e in job["errors"]["data"]))
    return "  |  ".join(parts)


def _write_lines(lines: Iterable[bytes], path: str | None, *, live: bool = False) -> int:
    """Write to ``path`` (atomically, via a ``.partial`` file) or stdout (``live``: flush
    every line, for ``--follow``)."""
    count = 0
    if path is None or path == "-":
        out = sys.stdout.buffer
        for line in lines:
            out.write(line)
            count += 1
            if live or count % 64 == 0:
                out.flush()
        out.flush()
        return count
    tmp = f"{path}.partial"
    with open(tmp, "wb") as f:
        for line in lines:
            f.write(line)
            count += 1
    os.replace(tmp, path)
    return count


# ---- commands ---------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from worker.client import Client
    from worker.local import run_job

    settings = load_settings(worker_concurrency=args.concurrency)
    bar: Any = None
    lock = threading.Lock()  # shard threads report progress concurrently

    def on_start(job: dict[str, Any]) -> None:
        nonlocal bar
        counts = job["request_counts"]
        if not args.quiet:
            bar = tqdm(total=counts["total"], initial=counts["failed"], unit="req", desc="conveyor run", file=sys.stderr)

    def on_items(n: int) -> None:
        if bar is not None:
            with lock:
                bar.update(n)

    try:
        job = run_job(
            settings, args.input, args.model, shard_size=args.shard_size, priority=args.priority,
            on_start=on_start, on_items=on_items,
        )  # fmt: skip
    finally:
        if bar is not None:
            bar.close()
    client = Client(settings)
    try:
        if job["status"] != "failed":
            _write_lines(client.result_bytes(job["id"]), args.output)
            if args.errors:
                _write_lines(client.result_bytes(job["id"], errors=True), args.errors)
    finally:
        client.close()
    print(_summary(job), file=sys.stderr)
    return 0 if job["status"] == "completed" else EXIT_ERROR


def cmd_submit(args: argparse.Namespace) -> int:
    with _client() as client:
        job = client.submit(args.input, args.model, args.shard_size, args.priority)
    if args.json:
        _print_json(job)
    elif job["status"] == "failed":
        print(_summary(job), file=sys.stderr)
    else:
        print(job["id"])
    return EXIT_ERROR if job["status"] == "failed" else 0


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.app import create_app
    from worker.context import WorkerContext
    from worker.queues import canonical_model
    from worker.service import prepare_database

    model = args.model or load_settings().model
    if not model:
        raise UserError("no model to serve: pass --model or set CONVEYOR_MODEL")
    settings = load_settings(worker_concurrency=args.concurrency, model=canonical_model(model))
    ctx = WorkerContext.create(settings, model)  # checks engine args and the schema up front
    try:
        prepare_database(ctx)
        queue = ctx.queue
    finally:
        ctx.close()
    app = create_app(settings)
    argv = [
        "worker", "--pool=threads", f"--concurrency={settings.worker_concurrency}", f"--queues={queue}",
        f"--loglevel={args.loglevel or settings.log_level}", "--without-gossip", "--without-mingle",
        f"--hostname=conveyor-{os.getpid()}@%h",
    ]  # fmt: skip
    app.worker_main(argv)
    return 0


def _show(job: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _print_json(job)
    else:
        print(_summary(job))


def cmd_status(args: argparse.Namespace) -> int:
    with _client() as client:
        job = client.status(args.job)
    _show(job, args.json)
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    with _client() as client:
        lines = client.result_bytes(args.job, errors=args.errors, follow=args.follow)
        _write_lines(lines, args.output, live=args.follow)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client() as client:
        job = client.cancel(args.job)
    _show(job, args.json)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from worker.bench import TokenRange, format_result, run_bench

    settings = load_settings()
    result = run_bench(
        args.model,
        requests=args.requests,
        prompt_tokens=TokenRange.parse(args.prompt_tokens, "--prompt-tokens"),
        output_tokens=TokenRange.parse(args.output_tokens, "--output-tokens"),
        shared_prefix=args.shared_prefix,
        seed=args.seed,
        engine_args=settings.engine_args,
    )
    if args.json:
        _print_json(result.as_dict())
    else:
        print(format_result(result))
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from worker.store.schema import upgrade_database

    settings = load_settings()
    if settings.database_url is None:
        settings.ensure_home()
    revision = upgrade_database(settings.database)
    print(f"database {redact_url(settings.database)} is at schema revision {revision}")
    return 0


# ---- parser -----------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor", description="Queue-driven batch inference for LLMs.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a whole job in this process (no broker needed)")
    run.add_argument("input", help="input file: OpenAI Batch JSONL, plain JSONL with a prompt, or CSV")
    run.add_argument("--model", required=True, help="hub id (e.g. Qwen/Qwen3-0.6B) or local checkpoint directory")
    run.add_argument("-o", "--output", help="write the results file here (default: stdout)")
    run.add_argument("--errors", help="write the errors file here")
    run.add_argument("--shard-size", type=_positive_int)
    run.add_argument("--priority", type=_positive_int)
    run.add_argument("--concurrency", type=_positive_int, help="shards run at once (default CONVEYOR_WORKER_CONCURRENCY)")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    run.set_defaults(fn=cmd_run)

    submit = sub.add_parser("submit", help="validate and enqueue a job; prints its id")
    submit.add_argument("input")
    submit.add_argument("--model", required=True)
    submit.add_argument("--shard-size", type=_positive_int)
    submit.add_argument("--priority", type=_positive_int, help="lower runs first under the priority policy (0)")
    submit.add_argument("--json", action="store_true", help="print the job object")
    submit.set_defaults(fn=cmd_submit)

    worker = sub.add_parser("worker", help="serve a model's queue (Celery worker, threads pool)")
    worker.add_argument("--model", help="default CONVEYOR_MODEL")
    worker.add_argument("--concurrency", type=_positive_int, help="shard tasks at once (default 4)")
    worker.add_argument("--loglevel", help="default CONVEYOR_LOG_LEVEL")
    worker.set_defaults(fn=cmd_worker)

    status = sub.add_parser("status", help="show a job")
    status.add_argument("job")
    status.add_argument("--json", action="store_true")
    status.set_defaults(fn=cmd_status)

    results = sub.add_parser("results", help="print (or save) a job's results or errors file")
    results.add_argument("job")
    results.add_argument("-o", "--output", help="write here instead of stdout")
    results.add_argument("--errors", action="store_true", help="the errors file instead")
    results.add_argument("--follow", action="store_true", help="stream a running job's results as shards finish")
    results.set_defaults(fn=cmd_results)

    cancel = sub.add_parser("cancel", help="cancel a job (results so far are kept)")
    cancel.add_argument("job")
    cancel.add_argument("--json", action="store_true")
    cancel.set_defaults(fn=cmd_cancel)

    bench = sub.add_parser("bench", help="measure the engine on this machine with a synthetic batch workload")
    bench.add_argument("--model", required=True, help="local checkpoint directory or hub id")
    bench.add_argument("--requests", type=int, default=256)
    bench.add_argument("--prompt-tokens", default="64-512", help="N or LOW-HIGH (default 64-512)")
    bench.add_argument("--output-tokens", default="10-500", help="N or LOW-HIGH, EOS ignored (default 10-500)")
    bench.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix every prompt shares")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.set_defaults(fn=cmd_bench)

    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = db_sub.add_parser("upgrade", help="apply the migrations (creates the schema)")
    upgrade.set_defaults(fn=cmd_db_upgrade)
    return p


def _user_error_types() -> tuple[type[BaseException], ...]:
    from kombu.exceptions import OperationalError as BrokerError
    from sqlalchemy.exc import OperationalError as DBError

    from worker.client import JobNotFinished
    from worker.context import ConfigError
    from worker.formats import InputError
    from worker.jobs import JobNotFound, SubmitError
    from worker.keys import InvalidJobId
    from worker.queues import InvalidModel
    from worker.store.objects import InvalidKey, ObjectNotFound
    from worker.store.schema import SchemaError

    return (
        UserError, ConfigError, InputError, InvalidModel, InvalidJobId, JobNotFound, JobNotFinished, SubmitError,
        SchemaError, ObjectNotFound, InvalidKey, FileNotFoundError, IsADirectoryError, PermissionError,
        TimeoutError, ValueError, DBError, BrokerError,
    )  # fmt: skip


def _describe(exc: BaseException) -> str:
    from sqlalchemy.exc import OperationalError as DBError

    if isinstance(exc, DBError):
        lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return f"cannot use the database: {lines[0] if lines else type(exc).__name__}"
    text = str(exc) or type(exc).__name__
    if type(exc).__module__.startswith("kombu"):
        return f"cannot reach the broker: {text}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("CONVEYOR_LOG_LEVEL", "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s")
    fn: Callable[[argparse.Namespace], int] = args.fn
    try:
        return fn(args)
    except KeyboardInterrupt:
        print("conveyor: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except Exception as exc:
        if args.debug or not isinstance(exc, _user_error_types()):
            if not args.debug:
                print(f"conveyor: internal error: {type(exc).__name__}: {exc} (run with --debug for details)", file=sys.stderr)
                return EXIT_ERROR
            raise
        print(f"conveyor: error: {_describe(exc)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
