"""The Python client: ``Client().submit / status / wait / results / cancel``.

>>> c = Client()                                     # CONVEYOR_* settings, or embedded
>>> job = c.submit("requests.jsonl", model="Qwen/Qwen3-0.6B")
>>> c.wait(job["id"], timeout=3600)["status"]
'completed'
>>> for line in c.results(job["id"]): ...            # OpenAI Batch output lines (str)

Jobs are batch objects (dicts shaped like OpenAI's). The embedded SQLite database is
migrated on first use; any other database must already be (``conveyor db upgrade``).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy.engine import Engine

from conveyor.worker.batchio.peek import peek
from conveyor.worker.batchio.readers import detect_format
from conveyor.worker.batchio.records import InputFormat
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.broker.config import celery_app
from conveyor.worker.broker.queues import DEFAULT_QUEUE, check_broker, enqueue_shards, queue_name
from conveyor.worker.core.settings import Settings, get_settings
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.expiry import expire_if_due
from conveyor.worker.jobs.files import expiry_time, outputs_expired_at
from conveyor.worker.jobs.finalize import job_shards
from conveyor.worker.jobs.lifecycle import (
    NotRetryable,
    cancel_job,
    get_job,
    job_model,
    list_jobs,
    reopen_unenqueued,
)
from conveyor.worker.jobs.live_lines import FollowState, FollowTarget, IntakeFailed, Order, follow_lines
from conveyor.worker.jobs.model_names import InvalidModel
from conveyor.worker.jobs.output_files import ShardSource, iter_job_output, iter_lines
from conveyor.worker.jobs.submission import SubmitOptions, submit_job
from conveyor.worker.jobs.unfinished_reads import open_unfinished
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import JobStatus
from conveyor.worker.store.objects.base import ObjectNotFound, ObjectStore
from conveyor.worker.store.objects.factory import open_store_from_settings
from conveyor.worker.store.schema import ensure_schema
from conveyor.worker.store.workers import ModelService, model_service

InputSource = str | os.PathLike[str] | bytes | BinaryIO


class JobFailed(RuntimeError):
    """Results were asked for of a job that failed before running (it has none)."""


class JobNotFinished(RuntimeError):
    """Results were asked for before the job finished (and without ``follow``)."""


class Client:
    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self._db: Engine | None = None
        self._store: ObjectStore | None = None
        self._app: Any = None

    # ---- connections (lazy) -----------------------------------------------------------

    @property
    def db(self) -> Engine:
        if self._db is None:
            db = create_db_engine(self.settings.database)
            try:
                ensure_schema(self.settings, db)
            except Exception:
                db.dispose()
                raise
            self._db = db
        return self._db

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            self._store = open_store_from_settings(self.settings)
        return self._store

    @property
    def app(self) -> Any:
        """A send-only Celery app (tasks go by name to each job's model queue)."""
        if self._app is None:
            if self.settings.broker_url is None:
                self.settings.ensure_home()
            self._app = celery_app(self.settings, DEFAULT_QUEUE)
        return self._app

    def close(self) -> None:
        if self._db is not None:
            self._db.dispose()
            self._db = None
        if self._app is not None:
            self._app.close()
            self._app = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- jobs -------------------------------------------------------------------------

    def submit(
        self,
        input: InputSource,
        model: str,
        shard_size: int | None = None,
        priority: int | None = None,
        *,
        input_format: InputFormat | str | None = None,
        metadata: dict[str, Any] | None = None,
        completion_window: str | None = None,
        enqueue: bool = True,
        on_created: Callable[[str], None] | None = None,
        chat: bool | None = None,
        system_prompt: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        n: int | None = None,
        response_format: dict[str, Any] | None = None,
        shard_order: str | None = None,
    ) -> dict[str, Any]:
        """Validate and store the input, create the job and enqueue its shards on the
        model's queue; returns the job (``status`` ``failed`` if the input was rejected as a
        whole). ``input_format`` forces the format (else its content and name decide);
        ``metadata``: OpenAI's (at most 16 string pairs); ``completion_window``: ``"24h"``,
        ``"7d"``, ... (default ``CONVEYOR_COMPLETION_WINDOW``). ``enqueue=False`` leaves the
        shards for an in-process runner; ``on_created(job_id)`` runs once the job exists.

        Request options, for every line: ``chat`` renders plain ``prompt`` rows through the
        model's chat template (None, the default: when the model has one; False: never);
        ``system_prompt`` goes first in every chat request without a system message of its
        own; ``max_tokens`` ... ``response_format`` are defaults under each line's own fields
        (OpenAI's body fields; a line's value wins). ``shard_order``: ``"prefix"`` groups lines
        sharing a prompt prefix into shards, ``"input"`` keeps consecutive runs (default
        ``CONVEYOR_SHARD_ORDER``)."""
        request_options = RequestOptions.from_fields(
            chat=chat, system_prompt=system_prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            seed=seed, stop=stop, n=n, response_format=response_format,
        )  # fmt: skip
        fmt = InputFormat(input_format) if input_format is not None else None
        sender = None
        if enqueue:

            def sender(job_id: str, indices: Any) -> None:
                enqueue_shards(
                    self.app, queue_name(job_model(self.db, job_id), self.settings.queue_prefix), job_id, indices
                )

        local = Path(model).expanduser()
        if local.is_dir() or (local.suffix == ".gguf" and local.is_file()):
            _check_local_checkpoint(model)
        stream, name = _open_input(input)
        with stream:
            # Mistakes in the broker or the store are named now, before a job exists or a byte is sent.
            if enqueue:
                check_broker(self.app)
            self.store.check()
            head, peeked = peek(stream)  # the content decides the format as well as the name
            fmt = fmt or detect_format(name, head)
            options = SubmitOptions(
                model=model,
                shard_size=shard_size,
                priority=priority or 0,
                input_format=fmt,
                completion_window=completion_window,
                request_options=request_options,
                shard_order=shard_order,
            )
            return submit_job(
                self.db, self.store, self.settings, peeked, options,
                enqueue=sender, metadata=metadata, on_created=on_created,
            )  # fmt: skip

    def retry(self, job_id: str) -> dict[str, Any]:
        """Enqueue again a job whose shards could not be enqueued (the broker was down when it
        was submitted), from its stored input: nothing is uploaded again."""
        check_broker(self.app)
        job_store = self.store.scoped(object_keys.job_prefix(job_id))
        if JobStatus(get_job(self.db, job_id)["status"]) is JobStatus.failed and not any(job_store.list("shards/")):
            raise NotRetryable(
                f"job {job_id} cannot be retried: its shards were deleted "
                f"{self.settings.storage_grace_seconds:.0f} s after it failed (CONVEYOR_STORAGE_GRACE_SECONDS)"
            )
        indices = reopen_unenqueued(self.db, job_id)
        queue = queue_name(job_model(self.db, job_id), self.settings.queue_prefix)
        enqueue_shards(self.app, queue, job_id, indices)
        return get_job(self.db, job_id)

    def jobs(self, status: Sequence[str] = (), limit: int = 20, after: str | None = None) -> list[dict[str, Any]]:
        """Jobs (batch objects), newest first; ``status`` filters, ``after`` pages on."""
        return list_jobs(self.db, statuses=[JobStatus(s) for s in status], limit=limit, after=after)

    def status(self, job_id: str) -> dict[str, Any]:
        """The job; one past its completion window is expired first (workers do it too, but
        none may be running)."""
        self._expire_if_due(job_id)
        return get_job(self.db, job_id, refresh=True)

    def model_service(self, model: str) -> ModelService:
        """Who serves ``model`` (canonical, as jobs record it): live workers and the last
        heartbeat of any that ever did (``CONVEYOR_WORKER_LIVE_SECONDS``)."""
        return model_service(self.db, model, self.settings.worker_live_seconds)

    def _expire_if_due(self, job_id: str) -> None:
        object_keys.check_job_id(job_id)
        expire_if_due(self.db, self.store, job_id, heartbeat_seconds=self.settings.heartbeat_seconds)

    def wait(self, job_id: str, timeout: float | None = None, poll: float = 1.0) -> dict[str, Any]:
        """Poll until the job is completed, failed, cancelled or expired; ``TimeoutError`` after
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.status(job_id)
            if JobStatus(job["status"]).terminal:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                counts = job["request_counts"]
                raise TimeoutError(
                    f"job {job_id} is still {job['status']} after {timeout:g} s "
                    f"({counts['completed'] + counts['failed']} of {counts['total']} requests done)"
                )
            time.sleep(poll)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return cancel_job(self.db, self.store, job_id, heartbeat_seconds=self.settings.heartbeat_seconds)

    # ---- results ------------------------------------------------------------------------

    def unfinished_bytes(self, job_id: str) -> Iterator[bytes]:
        """A cancelled or expired job's input lines that never ran, as submitted (a CSV with its
        header; Parquet as a file's chunks), ready to submit again; nothing for a completed job.
        ``NotEnded`` while the job runs."""
        return iter_lines(open_unfinished(self.db, self.store, job_id))

    def result_bytes(
        self,
        job_id: str,
        errors: bool = False,
        *,
        follow: bool = False,
        order: Order | str = Order.input,
        poll: float = 0.5,
        on_wait: Callable[[FollowState], None] | None = None,
    ) -> Iterator[bytes]:
        """The results (or errors) file's lines as bytes. A finished job's come from its
        file; with ``follow`` a running job's come as each item is stored
        (``conveyor.worker.jobs.live_lines``): in ``order`` ``input``, the same lines in the
        same order as the file will hold, each once the lines before it are stored; in
        ``completion``, each as it is stored. ``on_wait(state)`` is called at each poll."""
        job = get_job(self.db, job_id)
        status = JobStatus(job["status"])
        if status is JobStatus.failed:
            reasons = "; ".join(e["message"] for e in (job["errors"] or {}).get("data", [])) or "no reason recorded"
            raise JobFailed(
                f"job {job_id} failed before running any request, so it has no results or errors file: "
                f"{reasons} (conveyor status {job_id} shows the job)"
            )
        if status.terminal:
            return self._ended_lines(job_id, job, errors)
        if not follow:
            raise JobNotFinished(
                f"job {job_id} is {status.value}; its results are ready when it completes "
                "(wait for it, or follow the results as they are stored)"
            )
        target = FollowTarget(self.db, self.store.scoped(object_keys.job_prefix(job_id)), job_id, errors)

        def final_lines() -> Iterator[bytes]:
            return self._ended_lines(job_id, get_job(self.db, job_id), errors)

        def on_poll(state: FollowState) -> None:
            self._expire_if_due(job_id)  # its window may pass while we follow
            if on_wait is not None:
                on_wait(state)

        lines = follow_lines(target, final_lines, order=Order(order), poll=poll, on_poll=on_poll)
        return _intake_failures_named(lines)

    def _ended_lines(self, job_id: str, job: dict[str, Any], errors: bool) -> Iterator[bytes]:
        """An ended job's results (or errors) lines: its file, or (not written) its items."""
        job_store = self.store.scoped(object_keys.job_prefix(job_id))
        if job["error_uri"] if errors else job["output_uri"]:
            try:
                return iter_lines(job_store.open_read(object_keys.ERRORS if errors else object_keys.RESULTS))
            except ObjectNotFound:
                expired = outputs_expired_at(job.get("metrics"))
                if expired is not None:  # its items went with its files
                    raise ObjectNotFound(
                        f"the output files of job {job_id} expired at {expiry_time(expired)} and were deleted"
                    ) from None
        source = ShardSource.of_job(self.db, job_store, job_id)
        return iter_job_output(source, job_shards(self.db, job_id), errors=errors)

    def results(
        self,
        job_id: str,
        errors: bool = False,
        *,
        follow: bool = False,
        order: Order | str = Order.input,
        to: str | os.PathLike[str] | BinaryIO | None = None,
    ) -> Iterator[str] | int:
        """Lines of the results (or errors) file as ``str`` (no newline); with ``to`` (a path
        or binary file) the lines are written there instead and their count returned."""
        lines = self.result_bytes(job_id, errors, follow=follow, order=order)
        if to is None:
            return (line.decode("utf-8").rstrip("\n") for line in lines)
        count = 0
        if isinstance(to, (str, os.PathLike)):
            with open(to, "wb") as f:
                for line in lines:
                    f.write(line)
                    count += 1
            return count
        for line in lines:
            to.write(line)
            count += 1
        return count


def _intake_failures_named(lines: Iterator[bytes]) -> Iterator[bytes]:
    try:
        yield from lines
    except IntakeFailed as exc:
        raise JobFailed(str(exc)) from None


def _open_input(source: InputSource) -> tuple[BinaryIO, str]:
    if isinstance(source, (bytes, bytearray)):
        return io.BytesIO(bytes(source)), "input.jsonl"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"input file {str(path)!r} does not exist or is not a file")
        return open(path, "rb"), path.name
    if hasattr(source, "read"):
        name = getattr(source, "name", None)
        return source, name if isinstance(name, str) and name else "input.jsonl"
    raise TypeError(f"input must be a path, bytes or a binary file, got {type(source).__name__}")


def _check_local_checkpoint(model: str) -> None:
    """A job for a local checkpoint no worker could load is refused now, with the reason,
    rather than waiting forever. (A hub id cannot be checked offline: workers report it.)"""
    # The engine, and torch with it (seconds to import), only when a local path is submitted.
    from conveyor.engine.models.loader import check_checkpoint

    try:
        check_checkpoint(Path(model).expanduser())
    except ValueError as exc:
        raise InvalidModel(f"model {model} cannot be loaded: {exc}") from None
