"""``conveyor``: run | submit | worker | serve | keys | status | results | cancel | db upgrade | bench.

User errors (a missing file, a bad setting, an unknown job, a service that cannot be
reached) print one line, ``conveyor: error: ...``, and exit 1; URLs are shown redacted.

The commands that drive the engine (``run``, ``worker``, ``bench``) import it when they run:
torch takes seconds to import, and ``submit``, ``status`` or ``results`` never need it.
``serve`` imports the HTTP stack (FastAPI, uvicorn) when it runs, for the same reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from conveyor.worker.core.terminal_text import json_for_terminal, printable
from conveyor.worker.entrypoints.engine_flags import add_engine_flags, check_engine_flags, given_engine_flags
from conveyor.worker.entrypoints.request_flags import add_request_flags, request_options

# A base install (``pip install conveyor``, no ``worker`` extra) has the engine and this parser,
# not the job system: ``conveyor --help`` works there, and every command says which extra to
# install in one line instead of a traceback (``main``). Any other missing module is a bug: raised.
WORKER_EXTRA_MODULES = frozenset(
    {"kombu", "celery", "sqlalchemy", "alembic", "boto3", "botocore", "pydantic", "pydantic_settings", "psycopg",
     "redis", "prometheus_client", "fastapi", "starlette", "uvicorn", "multipart", "python_multipart"}
)  # fmt: skip
try:
    from kombu.exceptions import OperationalError as BrokerError
    from sqlalchemy.exc import OperationalError as DBError

    from conveyor.worker.batchio.error_summary import summarize_failures
    from conveyor.worker.batchio.records import InputError, InputFormat
    from conveyor.worker.broker.queues import BrokerUnavailable, queue_name, submit_queue_name
    from conveyor.worker.core.settings import ConfigError, Settings, read_settings, redact_url
    from conveyor.worker.entrypoints.client import Client, JobFailed, JobNotFinished
    from conveyor.worker.entrypoints.progress_bar import RunProgress, duration
    from conveyor.worker.jobs.catalog import is_declared
    from conveyor.worker.jobs.lifecycle import JobNotFound, NotRetryable
    from conveyor.worker.jobs.live_lines import FollowState
    from conveyor.worker.jobs.model_names import InvalidModel, canonical_model
    from conveyor.worker.jobs.object_keys import InvalidJobId
    from conveyor.worker.jobs.servable import unserved_refusal
    from conveyor.worker.jobs.submission import SubmitError
    from conveyor.worker.jobs.unfinished_reads import NotEnded, NoUnfinished
    from conveyor.worker.store.api_keys import (
        KeyNameError,
        KeyNotFound,
        active_key_count,
        create_key,
        list_keys,
        revoke_key,
    )
    from conveyor.worker.store.database import create_db_engine
    from conveyor.worker.store.model_cache import fetch_model, is_model_uri
    from conveyor.worker.store.models import JobStatus
    from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, StorageUnavailable
    from conveyor.worker.store.schema import SchemaError, ensure_schema, upgrade_database
    from conveyor.worker.store.workers import ModelService
except ModuleNotFoundError as exc:
    if (exc.name or "").partition(".")[0] not in WORKER_EXTRA_MODULES:
        raise
    MISSING_EXTRA: str | None = exc.name
else:
    MISSING_EXTRA = None

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130

# Choices a base install cannot list (its commands stop at the missing extra before using them).
FORMATS = [f.value for f in InputFormat] if MISSING_EXTRA is None else None
FORMAT_HELP = "the input's format (default: from its first bytes, then its name)"


class UserError(Exception):
    """An error to show as one line, without a traceback."""


# ---- helpers ---------------------------------------------------------------------------


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment; ``overrides`` (command-line values) win and are
    validated like the rest."""
    return read_settings(**overrides)


def _engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Settings overrides for the engine flags given on the command line (``engine_flags``):
    ``CONVEYOR_ENGINE_ARGS`` with them on top (the flag wins); empty when none is."""
    given = given_engine_flags(args)
    if not given:
        return {}
    return {"engine_args": {**read_settings().engine_args, **given}}


def _checked_engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``_engine_overrides``, each flag's value first checked by the engine's config: a bad one
    is refused by its flag before anything loads."""
    try:
        check_engine_flags(given_engine_flags(args))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return _engine_overrides(args)


def _client(settings: Settings | None = None) -> Client:
    return Client(settings or load_settings())


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


def progress_text(job: dict[str, Any]) -> str | None:
    """A running job's rate, time left and tokens so far, in words (None when not running)."""
    p = job.get("progress")
    if not p:
        return None
    eta = duration(p["eta_seconds"]) if p["eta_seconds"] is not None else p.get("eta_note") or "unknown"
    if p["requests_per_second"] is None:
        rate = f"just started, ETA {eta}"
    else:
        rate = (
            f"{p['requests_per_second']:.2f} req/s and {p['output_tokens_per_second']:.0f} tok/s over the last "
            f"{p['window_seconds']:.0f} s, ETA {eta}"
        )
    return f"{p['done']}/{p['total']} done, {rate}, {p['output_tokens']:,} output tokens so far"


def _summary(job: dict[str, Any]) -> str:
    c = job["request_counts"]
    parts = [f"{job['id']}  {job['status']}", f"{c['completed']} completed, {c['failed']} failed of {c['total']}"]
    if (progress := progress_text(job)) is not None:
        parts.append(progress)
    if job.get("output_uri"):
        parts.append(f"results: {job['output_uri']}")
    if job.get("error_uri") and c["failed"]:
        parts.append(f"errors: {job['error_uri']}")
    if job.get("errors"):
        parts.append(printable("; ".join(e.get("message", "") for e in job["errors"]["data"])))
    return "  |  ".join(parts)


def run_summary(job: dict[str, Any], seconds: float, output: str | None, errors: str | None) -> str:
    """``conveyor run``'s last word, one short line starting with the job id: what came of its
    requests, where they went (the job's own files are under CONVEYOR_HOME; ``conveyor results`` reads them)."""
    c = job["request_counts"]
    text = (
        f"{job['id']} {job['status']} in {duration(seconds)}: {c['completed']} completed, "
        f"{c['failed']} failed of {c['total']}"
    )
    if job["status"] == "failed":  # the reason follows, as the error line
        return text
    places = [f"results in {output or 'stdout'}"]
    if c["failed"]:
        places.append(f"errors in {errors}" if errors else "errors: --errors FILE")
    return f"{text}; {', '.join(places)}"


def service_note(service: ModelService, declared: bool = False) -> str | None:
    """What to say when no live worker serves a job's model (None when one does); ``declared``:
    the model is in CONVEYOR_MODELS, so the deployment's autoscaler starts a worker for it."""
    if service.live:
        return None
    if declared:
        return f"no worker serves model {service.model} yet; it is declared (CONVEYOR_MODELS): an autoscaler starts one"
    start = f"start one with: conveyor worker --model {service.model}"
    if service.last_heartbeat_at is None:
        return f"no worker has ever served model {service.model}; {start}"
    age = max(0.0, time.time() - service.last_heartbeat_at)
    ago = f"{age / 60:.0f} min" if age >= 60 else f"{age:.0f} s"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(service.last_heartbeat_at))
    return f"no worker has served model {service.model} for {ago} (last heartbeat {when}); {start}"


def no_success_reason(job: dict[str, Any], errors_hint: str) -> str | None:
    """Why no request of a finished ``job`` succeeded (None if one did); ``errors_hint``
    says where the errors file is."""
    counts = job["request_counts"]
    if counts["completed"]:
        return None
    if job.get("errors"):
        return "; ".join(e.get("message", "") for e in job["errors"]["data"])
    total = counts["total"]
    if not total:
        return "the input has no requests"
    if not job.get("num_shards"):
        return f"all {total} lines were rejected, see {errors_hint}"
    return f"all {total} requests failed, see {errors_hint}"


def _write_lines(lines: Iterable[bytes], path: str | None, *, live: bool = False) -> int:
    """Write to ``path`` (atomically, via a ``.partial`` file) or stdout. ``live`` (for
    ``--follow``): every line is flushed as it comes, to ``path`` itself, which grows line by
    line."""
    count = 0
    if path is None or path == "-":
        out = sys.stdout.buffer
        terminal = sys.stdout.isatty()
        for line in lines:
            out.write(json_for_terminal(line) if terminal else line)
            count += 1
            if live or count % 64 == 0:
                out.flush()
        out.flush()
        return count
    if live:
        with open(path, "wb") as f:
            for line in lines:
                f.write(line)
                f.flush()
                count += 1
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
    from conveyor.worker.entrypoints.local_runner import run_job  # the engine (see the module docstring)

    began = time.monotonic()
    settings = load_settings(worker_concurrency=args.concurrency, **_checked_engine_overrides(args))
    bar = RunProgress()
    started: list[dict[str, Any]] = []

    def on_start(job: dict[str, Any]) -> None:
        started.append(job)
        counts = job["request_counts"]
        if not args.quiet:
            bar.start(counts["total"], counts["failed"])

    def on_loading() -> None:
        if not args.quiet:
            print(f"conveyor: loading model {args.model} ...", file=sys.stderr, flush=True)

    def on_loaded(seconds: float, has_template: bool) -> None:
        if args.quiet:
            return
        chat = {True: "on", False: "off"}.get(
            args.chat, "on (auto)" if has_template else "off (auto: the model has no chat template)"
        )
        print(f"conveyor: model loaded in {seconds:.1f} s; chat template for prompt rows: {chat}", file=sys.stderr)

    try:
        job = run_job(
            settings, args.input, args.model, shard_size=args.shard_size, priority=args.priority,
            input_format=args.format, shard_order=args.shard_order, on_start=on_start, on_records=bar.add,
            submit_options=request_options(args), on_loading=on_loading, on_loaded=on_loaded,
        )  # fmt: skip
    except KeyboardInterrupt as exc:
        job_id = getattr(exc, "job_id", None) or (started[0]["id"] if started else None)
        if job_id is not None:  # run_job cancelled it; what finished is kept
            print(
                f"\nconveyor: interrupted: job {job_id} is cancelled and keeps the requests it finished; "
                f"get them with: conveyor results {job_id} -o results.jsonl (and --errors for the errors "
                f"file), with the same CONVEYOR_HOME ({settings.home_dir})",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
        raise
    finally:
        bar.close()
    client = Client(settings)
    try:
        kinds_failed: list[str] = []
        if job["status"] != "failed":
            _write_lines(client.result_bytes(job["id"]), args.output)
            if args.errors:
                _write_lines(client.result_bytes(job["id"], errors=True), args.errors)
            if job["request_counts"]["failed"]:
                kinds, others = summarize_failures(client.result_bytes(job["id"], errors=True))
                kinds_failed = [k.describe() for k in kinds] + ([f"{others} other kinds"] if others else [])
    finally:
        client.close()
    print(run_summary(job, time.monotonic() - began, args.output, args.errors), file=sys.stderr)
    if kinds_failed:
        print(f"conveyor: why they failed: {'; '.join(kinds_failed)}", file=sys.stderr)
    why = no_success_reason(job, args.errors or "the errors file (--errors FILE writes it)")
    if why is not None:
        print(f"conveyor: error: no request succeeded: {why}", file=sys.stderr)
        return EXIT_ERROR
    return 0 if job["status"] == "completed" else EXIT_ERROR


def cmd_submit(args: argparse.Namespace) -> int:
    with _client() as client:
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
    if args.json:
        _print_json(job)
    elif job["status"] == "failed":
        print(_summary(job), file=sys.stderr)
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


def cmd_worker(args: argparse.Namespace) -> int:
    # The engine (see the module docstring).
    from conveyor.worker.broker.app import create_app
    from conveyor.worker.execution.context import WorkerContext

    base = load_settings()
    model = args.model or base.model
    if not model:
        raise UserError("no model to serve: pass --model or set CONVEYOR_MODEL")
    settings = load_settings(
        worker_concurrency=args.concurrency, model=canonical_model(model),
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, served_model_name=args.served_model_name,
        drain_timeout_seconds=args.drain_timeout, exit_when_idle_seconds=args.exit_when_idle,
        cpu_threads=args.cpu_threads, **_checked_engine_overrides(args),
    )  # fmt: skip
    ctx = WorkerContext.create(settings, model)  # checks engine args and the schema up front
    try:
        ensure_schema(settings, ctx.db)
        ctx.store.check()
    finally:
        ctx.close()
    prefix = settings.queue_prefix
    queues = f"{queue_name(ctx.model, prefix)},{submit_queue_name(prefix)}"  # (intake: a lane of its own)
    app = create_app(settings)
    argv = [
        "worker", "--pool=threads", f"--concurrency={settings.worker_concurrency}", f"--queues={queues}",
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


def _where(settings: Settings) -> str:
    """The database a command read, for when it found nothing there."""
    where = f"the database {redact_url(settings.database)}"
    if settings.database_url is None:
        where += f" (CONVEYOR_HOME={settings.home_dir}; set CONVEYOR_HOME or CONVEYOR_DATABASE_URL to read another)"
    return where


def waiting_note(client: Client, job: dict[str, Any]) -> tuple[ModelService | None, str | None]:
    """Who serves an unfinished ``job``'s model, and what to say while no live worker does
    (``status`` and ``results --follow`` repeat it); ``(None, None)`` for a job that ended."""
    if JobStatus(job["status"]).terminal:
        return None, None
    service = client.model_service(job["model"])
    return service, service_note(service, is_declared(client.settings, job["model"]))


def cmd_status(args: argparse.Namespace) -> int:
    with _client() as client:
        try:
            job = client.status(args.job)
        except JobNotFound as exc:
            raise JobNotFound(f"{exc} in {_where(client.settings)}") from None
        service, note = waiting_note(client, job)
    if args.json:
        if service is not None:  # an extra field beside OpenAI's: who serves the job's model
            job["serving"] = {**service.as_dict(), "note": note}
        _print_json(job)
    else:
        print(_summary(job) + (f"\n{note}" if note else ""))
    return 0


FOLLOW_REPORT_SECONDS = 2.0


def cmd_results(args: argparse.Namespace) -> int:
    if args.unfinished:
        return _write_unfinished(args)
    with _client() as client:
        last = [-FOLLOW_REPORT_SECONDS]

        def report(state: FollowState) -> None:
            """While following, say on stderr how far the job is (every couple of seconds)."""
            if time.monotonic() - last[0] < FOLLOW_REPORT_SECONDS:
                return
            last[0] = time.monotonic()
            job = client.status(args.job)
            if not state.num_shards:
                print(f"conveyor: waiting for the job's intake ({job['status']})", file=sys.stderr, flush=True)
            else:
                text = progress_text(job) or job["status"]
                print(f"conveyor: {state.written} lines written; {text}", file=sys.stderr, flush=True)
            if (note := waiting_note(client, job)[1]) is not None:
                print(f"conveyor: {note}", file=sys.stderr, flush=True)

        lines = client.result_bytes(args.job, errors=args.errors, follow=args.follow, order=args.order, on_wait=report)
        if args.format == "parquet":
            return _write_parquet(lines, args)
        _write_lines(lines, args.output, live=args.follow)
    return 0


def _write_unfinished(args: argparse.Namespace) -> int:
    if args.errors or args.follow or args.format != "jsonl":
        raise UserError(
            "--unfinished writes the input lines that never ran, as submitted: no --errors, --follow or --format"
        )
    with _client() as client:
        count = _write_lines(client.unfinished_bytes(args.job), args.output)
    if args.output not in (None, "-"):
        print(f"conveyor: wrote the unfinished input of {args.job} to {args.output} ({count} lines)", file=sys.stderr)
    return 0


def _write_parquet(lines: Iterable[bytes], args: argparse.Namespace) -> int:
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


def cmd_retry(args: argparse.Namespace) -> int:
    with _client() as client:
        job = client.retry(args.job)
    _show(job, args.json)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client() as client:
        status = client.status(args.job)["status"]
        if status in ("completed", "failed", "expired"):
            raise UserError(f"job {args.job} already {status}: there is nothing to cancel")
        job = client.cancel(args.job)  # a cancelled job stays so: cancelling is idempotent
    _show(job, args.json)
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client() as client:
        jobs = client.jobs(args.status or (), limit=args.limit, after=args.after)
        if not jobs and not args.json:
            print(f"conveyor: no jobs{' in that status' if args.status else ''} in {_where(client.settings)}",
                  file=sys.stderr)  # fmt: skip
    if args.json:
        _print_json({"object": "list", "data": jobs, "has_more": len(jobs) == args.limit})
        return 0
    for job in jobs:
        c = job["request_counts"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["created_at"]))
        print(
            f"{job['id']}  {job['status']:<11}  {c['completed']}/{c['failed']}/{c['total']} done/failed/total  "
            f"{created}  {job['model']}"
        )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from conveyor.testing.bench import TokenRange, format_result, run_bench  # the engine (see the module docstring)

    settings = load_settings()
    if is_model_uri(args.model):  # weights in an object store: the local copy (downloaded once)
        args.model = str(fetch_model(settings, args.model).path)
    if args.cold_start:
        return _bench_cold_start(settings, args)
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


def _bench_cold_start(settings: Settings, args: argparse.Namespace) -> int:

    from conveyor.testing.bench import format_cold_start, run_cold_start
    from conveyor.worker.execution.context import engine_config

    # The engine exactly as a worker builds it: its EngineConfig, CONVEYOR_ENGINE_ARGS applied.
    config = engine_config(settings, args.model).as_flat()
    model = config.pop("model")
    result = run_cold_start(model, engine_args=config, repeat=args.repeat)
    if args.json:
        _print_json(result.as_dict())
    else:
        print(format_cold_start(result))
    return 0


def _database(settings: Settings) -> Any:
    """The settings' database, with its schema checked (the embedded one migrated)."""
    if settings.is_embedded:
        settings.ensure_home()
    db = create_db_engine(settings.database)
    try:
        ensure_schema(settings, db)
    except BaseException:
        db.dispose()
        raise
    return db


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    settings = load_settings()
    if args.insecure_no_auth and not is_loopback(args.host):
        raise UserError(
            f"--insecure-no-auth serves without keys, so only on a loopback address (127.0.0.1, ::1), "
            f"not {args.host}; create a key with `conveyor keys create NAME` instead"
        )
    db = _database(settings)
    try:
        keys = active_key_count(db)
    finally:
        db.dispose()
    if not keys and not args.insecure_no_auth:
        raise UserError(
            "no API key exists, so no request could be served: create one with `conveyor keys create NAME` "
            "(it prints the key once), or start with --insecure-no-auth on a loopback address to serve without keys"
        )
    if keys and args.insecure_no_auth:
        print(
            f"conveyor: warning: --insecure-no-auth: {keys} API key(s) exist but none is asked for; what they "
            "created is not visible without them",
            file=sys.stderr,
        )
    import uvicorn  # the HTTP stack (see the module docstring)

    from conveyor.worker.api.app import create_app
    from conveyor.worker.api.http_server import uvicorn_options

    app = create_app(settings, insecure=args.insecure_no_auth)
    where = f"http://{'[' + args.host + ']' if ':' in args.host else args.host}:{args.port}/v1"
    keys_note = "no keys: insecure" if args.insecure_no_auth else "API keys required"
    print(
        f"conveyor serve: OpenAI-compatible API at {where} ({keys_note}); database "
        f"{redact_url(settings.database)}, broker {redact_url(settings.broker)}, "
        f"storage {redact_url(settings.storage)}"
        + (f"; taking broker submissions from {submit_queue_name(settings.queue_prefix)}"
           if settings.api_takes_submissions else ""),
        file=sys.stderr,
        flush=True,
    )  # fmt: skip
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=(args.loglevel or settings.log_level).lower(),
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=30,
        **uvicorn_options(settings),
    )
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    db = _database(load_settings())
    try:
        info, key = create_key(db, args.name)
    finally:
        db.dispose()
    print(key, flush=True)  # alone on its line of stdout: `KEY=$(conveyor keys create NAME)`
    print(
        f"conveyor: created API key {info.name!r} ({info.id}); it is shown only this once: keep it",
        file=sys.stderr,
    )
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    db = _database(load_settings())
    try:
        keys = list_keys(db)
    finally:
        db.dispose()
    if args.json:
        _print_json([k.as_dict() for k in keys])
        return 0

    def when(t: float | None) -> str:
        return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))

    for k in keys:
        state = "active" if k.active else f"revoked {when(k.revoked_at)}"
        print(f"{k.name}  {k.id}  created {when(k.created_at)}  last used {when(k.last_used_at)}  {state}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    db = _database(load_settings())
    try:
        info = revoke_key(db, args.name)
    finally:
        db.dispose()
    print(f"conveyor: API key {info.name!r} ({info.id}) is revoked", file=sys.stderr)
    return 0


def cmd_webhooks(args: argparse.Namespace) -> int:
    from conveyor.worker.jobs.webhook_dispatch import MAX_LISTED, recent_deliveries
    from conveyor.worker.store.models import WebhookDeliveryStatus

    if args.limit > MAX_LISTED:
        raise UserError(f"--limit: at most {MAX_LISTED}")
    settings = load_settings()
    db = _database(settings)
    try:
        rows = recent_deliveries(db, statuses=[WebhookDeliveryStatus(s) for s in args.status or ()], limit=args.limit)
    finally:
        db.dispose()
    for row in rows:
        row["url"] = redact_url(row["url"])
    if args.json:
        _print_json(rows)
        return 0
    if not rows:
        print("conveyor: no webhook deliveries" + (f" {'/'.join(args.status)}" if args.status else ""), file=sys.stderr)
    for row in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["updated_at"]))
        line = (
            f"{when}  {row['status']:<9}  {row['attempts']:>3} attempts  {row['event_id']}  {row['type']}  "
            f"{row['job_id']}  {row['url']}"
        )
        if row["status"] == "pending" and row["attempts"]:
            line += f"  next try {time.strftime('%H:%M:%S', time.localtime(row['next_attempt_at']))}"
        if row["status"] != "delivered" and row["last_error"]:
            line += f"  last error: {printable(row['last_error'])}"
        print(line)
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    settings = load_settings()
    if settings.database_url is None:
        settings.ensure_home()
    revision = upgrade_database(settings.database)
    print(f"database {redact_url(settings.database)} is at schema revision {revision}")
    return 0


# ---- parser -----------------------------------------------------------------------------


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _at_least_one(text: str) -> int:
    value = _positive_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {value}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (0 to 65535), got {value}")
    return value


def _version() -> str:
    try:
        return version("conveyor")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


JOB_STATUSES = [s.value for s in JobStatus] if MISSING_EXTRA is None else None
JOB_HELP = "the job id (batch_...), as submit printed it"
JSON_HELP = "print the job object as JSON (OpenAI's batch object)"
MODEL_HELP = "hub id (e.g. Qwen/Qwen3-0.6B), local checkpoint directory or s3://bucket/prefix/ (fetched once)"
INPUT_HELP = "input file: OpenAI Batch JSONL, plain JSONL with a prompt or messages, CSV or Parquet"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="conveyor",
        description="Queue-driven batch inference for LLMs. Configuration: CONVEYOR_* environment variables "
        "(the docs' settings reference); with none set, everything lives under CONVEYOR_HOME (~/.conveyor).",
    )
    p.add_argument("--version", action="version", version=f"conveyor {_version()}")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a whole job in this process (no broker needed)")
    run.add_argument("input", help=INPUT_HELP)
    run.add_argument("--model", required=True, help=MODEL_HELP)
    run.add_argument("-o", "--output", help="write the results file here (default: stdout)")
    run.add_argument("--errors", help="write the errors file here")
    run.add_argument("--format", choices=FORMATS, help=FORMAT_HELP)
    run.add_argument("--shard-size", type=_positive_int, help="requests per shard (default CONVEYOR_SHARD_SIZE)")
    run.add_argument(
        "--shard-order",
        choices=("prefix", "input"),
        help="prefix: shards group lines sharing a prompt prefix; input: consecutive lines "
        "(default CONVEYOR_SHARD_ORDER)",
    )
    run.add_argument("--priority", type=_positive_int, help="the job's priority: lower runs first (default 0)")
    run.add_argument(
        "--concurrency", type=_positive_int, metavar="SHARDS",
        help="shards run at once, not requests: every request of a running shard goes to the engine, which runs up "
        "to its max_num_seqs together (default CONVEYOR_WORKER_CONCURRENCY, 4)",
    )  # fmt: skip
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_request_flags(run)
    add_engine_flags(run)
    run.set_defaults(fn=cmd_run)

    submit = sub.add_parser("submit", help="validate and enqueue a job; prints its id")
    submit.add_argument("input", help=INPUT_HELP)
    submit.add_argument("--model", required=True, help=MODEL_HELP + "; workers serving it must run")
    submit.add_argument("--format", choices=FORMATS, help=FORMAT_HELP)
    submit.add_argument("--shard-size", type=_positive_int, help="requests per shard (default CONVEYOR_SHARD_SIZE)")
    submit.add_argument(
        "--shard-order",
        choices=("prefix", "input"),
        help="prefix: shards group lines sharing a prompt prefix; input: consecutive lines "
        "(default CONVEYOR_SHARD_ORDER)",
    )
    submit.add_argument("--priority", type=_positive_int, help="lower runs first under the priority policy (0)")
    submit.add_argument(
        "--completion-window", help="e.g. 24h, 1h, 7d (up to 30d; default CONVEYOR_COMPLETION_WINDOW, 24h)"
    )
    submit.add_argument(
        "--allow-unserved", action="store_true",
        help="submit even when neither CONVEYOR_MODELS nor a live worker names the model (it waits for a worker)",
    )  # fmt: skip
    submit.add_argument("--json", action="store_true", help=JSON_HELP)
    add_request_flags(submit)
    submit.set_defaults(fn=cmd_submit)

    worker = sub.add_parser("worker", help="serve a model's queue (Celery worker, threads pool)")
    worker.add_argument("--model", help=MODEL_HELP + " (default CONVEYOR_MODEL)")
    worker.add_argument(
        "--served-model-name",
        help="the public name jobs and API batches use for this model (body.model); default: --model itself "
        "(CONVEYOR_SERVED_MODEL_NAME)",
    )
    worker.add_argument(
        "--concurrency", type=_positive_int, metavar="SHARDS",
        help="shard tasks at once, not requests: every request of a running shard goes to the engine, which runs "
        "up to its max_num_seqs together (default CONVEYOR_WORKER_CONCURRENCY, 4)",
    )  # fmt: skip
    worker.add_argument(
        "--cpu-threads", type=_at_least_one, metavar="N",
        help="torch's CPU threads, exactly (default CONVEYOR_CPU_THREADS, else the CPUs this process may use, from "
        "its affinity and cgroup CPU quota, tuned down while a busy neighbour makes fewer faster)",
    )  # fmt: skip
    worker.add_argument("--loglevel", help="DEBUG, INFO, WARNING... (default CONVEYOR_LOG_LEVEL, INFO)")
    worker.add_argument(
        "--metrics-port", type=_port, help="serve Prometheus metrics at /metrics on this port (default "
        "CONVEYOR_METRICS_PORT; 0: none)",
    )  # fmt: skip
    worker.add_argument("--metrics-host", help="the metrics server's address (default CONVEYOR_METRICS_HOST, 0.0.0.0)")
    worker.add_argument(
        "--drain-timeout", type=_seconds, metavar="SECONDS",
        help="on SIGTERM, let running shards finish for up to this long, then hand back what is left and exit 0 "
        "(default CONVEYOR_DRAIN_TIMEOUT_SECONDS, 25)",
    )  # fmt: skip
    worker.add_argument(
        "--exit-when-idle", type=_seconds, metavar="SECONDS",
        help="drain and exit 0 once no task has come for this long (run-to-completion workers, e.g. a KEDA "
        "ScaledJob; default CONVEYOR_EXIT_WHEN_IDLE_SECONDS: never)",
    )  # fmt: skip
    add_engine_flags(worker)
    worker.set_defaults(fn=cmd_worker)

    jobs = sub.add_parser("jobs", help="list jobs, newest first")
    jobs.add_argument("--status", action="append", choices=JOB_STATUSES, help="only jobs in this status (repeatable)")
    jobs.add_argument("--limit", type=_positive_int, default=20, help="at most this many (default 20, up to 1000)")
    jobs.add_argument("--after", help="only jobs created before this job id (to page on)")
    jobs.add_argument("--json", action="store_true", help="print an OpenAI-style list of batch objects")
    jobs.set_defaults(fn=cmd_jobs)

    status = sub.add_parser("status", help="show a job")
    status.add_argument("job", help=JOB_HELP)
    status.add_argument("--json", action="store_true", help=JSON_HELP)
    status.set_defaults(fn=cmd_status)

    results = sub.add_parser("results", help="print (or save) a job's results or errors file")
    results.add_argument("job", help=JOB_HELP)
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

    cancel = sub.add_parser("cancel", help="cancel a job (results so far are kept)")
    cancel.add_argument("job", help=JOB_HELP)
    cancel.add_argument("--json", action="store_true", help=JSON_HELP)
    cancel.set_defaults(fn=cmd_cancel)

    retry = sub.add_parser("retry", help="enqueue again a job whose shards could not be enqueued at submit")
    retry.add_argument("job", help=JOB_HELP)
    retry.add_argument("--json", action="store_true", help=JSON_HELP)
    retry.set_defaults(fn=cmd_retry)

    bench = sub.add_parser("bench", help="measure the engine on this machine with a synthetic batch workload")
    bench.add_argument("--model", required=True, help=MODEL_HELP)
    bench.add_argument("--requests", type=int, default=256, help="requests, all submitted at once (default 256)")
    bench.add_argument("--prompt-tokens", default="64-512", help="N or LOW-HIGH (default 64-512)")
    bench.add_argument("--output-tokens", default="10-500", help="N or LOW-HIGH, EOS ignored (default 10-500)")
    bench.add_argument("--shared-prefix", type=int, default=0, help="tokens of a prefix every prompt shares")
    bench.add_argument("--seed", type=int, default=0, help="random seed of the prompts and lengths (default 0)")
    bench.add_argument(
        "--cold-start", action="store_true", help="instead: time fresh processes building the engine, by phase "
        "(import, weights, kv_cache, cuda_graphs)",
    )  # fmt: skip
    bench.add_argument(
        "--repeat", type=int, default=3, help="with --cold-start: fresh processes, one after another (default 3)"
    )
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.set_defaults(fn=cmd_bench)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible Files and Batches API over HTTP")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    serve.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve without API keys (everything owned by nobody); only on a loopback --host",
    )
    serve.add_argument("--loglevel", help="debug, info, warning... (default CONVEYOR_LOG_LEVEL, INFO)")
    serve.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    serve.set_defaults(fn=cmd_serve)

    keys = sub.add_parser("keys", help="API keys of the HTTP API (conveyor serve)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = keys_sub.add_parser("create", help="create a key; prints it once, alone on a line")
    create.add_argument("name", help="a name for the key: letters, digits, '.', '_', '-' (unique)")
    create.set_defaults(fn=cmd_keys_create)
    klist = keys_sub.add_parser("list", help="list keys (never the keys themselves)")
    klist.add_argument("--json", action="store_true", help="print them as JSON")
    klist.set_defaults(fn=cmd_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key: requests with it get 401 (within 2 s)")
    revoke.add_argument("name", help="the key's name")
    revoke.set_defaults(fn=cmd_keys_revoke)

    hooks = sub.add_parser("webhooks", help="list webhook deliveries, latest first (failed ones say why)")
    hooks.add_argument(
        "--status", action="append", choices=["pending", "delivered", "failed"],
        help="only deliveries in this state (repeatable)",
    )  # fmt: skip
    hooks.add_argument("--limit", type=_at_least_one, default=50, help="at most this many (default 50, at most 1000)")
    hooks.add_argument("--json", action="store_true", help="print them as JSON")
    hooks.set_defaults(fn=cmd_webhooks)

    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = db_sub.add_parser("upgrade", help="apply the migrations (creates the schema)")
    upgrade.set_defaults(fn=cmd_db_upgrade)
    return p


def _user_error_types() -> tuple[type[BaseException], ...]:
    return (
        UserError, ConfigError, InputError, InvalidModel, InvalidJobId, JobNotFound, JobNotFinished, JobFailed,
        SubmitError,
        NotRetryable, NotEnded, NoUnfinished,
        SchemaError, KeyNameError, KeyNotFound, ObjectNotFound, InvalidKey, StorageUnavailable,
        BrokerUnavailable,
        FileNotFoundError, IsADirectoryError, PermissionError, TimeoutError, ValueError, DBError, BrokerError,
    )  # fmt: skip


def _describe(exc: BaseException) -> str:
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
    if MISSING_EXTRA is not None:
        command = " ".join(
            str(getattr(args, key)) for key in ("command", "keys_command", "db_command") if getattr(args, key, None)
        )
        print(
            f"conveyor: error: 'conveyor {command}' needs the worker extra ({MISSING_EXTRA} is not installed): "
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
        if args.debug or not isinstance(exc, _user_error_types()):
            if not args.debug:
                what = printable(str(exc))
                print(
                    f"conveyor: internal error: {type(exc).__name__}: {what} (run with --debug for details)",
                    file=sys.stderr,
                )
                return EXIT_ERROR
            raise
        print(f"conveyor: error: {printable(_describe(exc))}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
