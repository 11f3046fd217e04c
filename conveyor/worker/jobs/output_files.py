"""Stored items as output lines: a shard's results part file, and the job's results/errors
streams.

Lines are built from the database rows, so a shard that ran twice (redelivery, takeover)
still yields each item once, byte-identical whoever writes it. A shard's part file holds its
results in input-line order. A job cut in input order has consecutive line ranges for shards,
so its results file is the parts in shard order. A job grouped by prefix has shards that are
sets of lines interleaving with each other: its results file is the job's stored items read
by line (through ``ix_items_job_line``, a server-side cursor: bounded memory), the same bytes
as an input-order run's. Its errors file merges the lines rejected
at validation (``invalid.jsonl``, each naming its line) with the failed items, by line
number. Failed items are read from the database: their lines, shaped as OpenAI's, carry no
line number to merge by (the error is in ``response``), and the rows are small.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.engine import Engine

from conveyor.worker.batchio.output_lines import UNRUN_CODES, dumps_line, error_line, failed_request_line, output_line
from conveyor.worker.jobs import object_keys
from conveyor.worker.store.models import Item, ItemStatus, Job
from conveyor.worker.store.objects.base import ObjectNotFound, ObjectStore

_ROWS_PER_FETCH = 1000


def item_line(job_id: str, row: Any) -> bytes:
    """The results-file (succeeded) or errors-file (failed) line of a stored item. A failed
    item ran and got an HTTP error (its ``status_code``, 4xx or 5xx), except a
    ``batch_expired`` or ``batch_cancelled`` one, which never ran: its line has no response, as
    OpenAI's has none."""
    if ItemStatus(row.status) is ItemStatus.succeeded:
        return dumps_line(output_line(job_id, row.custom_id, row.response or {}, row.status_code))
    err = row.error or {}
    if (code := err.get("code")) in UNRUN_CODES:
        message = str(err.get("message") or "")
        return dumps_line(error_line(job_id, row.custom_id, code=code, message=message, line=row.line))
    # (A failed item stored without an error status counts as a server error.)
    status_code = row.status_code if 400 <= row.status_code < 600 else 500
    return dumps_line(
        failed_request_line(
            job_id,
            row.custom_id,
            status_code=status_code,
            code=str(err.get("code") or "error"),
            message=str(err.get("message") or ""),
            line=row.line,
            param=err.get("param"),
        )
    )


def iter_shard_items(db: Engine, job_id: str, shard_index: int, *, failed: bool) -> Iterator[tuple[int, bytes]]:
    """``(line, output line)`` for each succeeded (or ``failed``) stored item of a shard, by
    input line."""
    status = ItemStatus.failed if failed else ItemStatus.succeeded
    stmt = (
        select(Item.custom_id, Item.line, Item.status, Item.status_code, Item.response, Item.error)
        .where(Item.job_id == job_id, Item.shard_index == shard_index, Item.status == status)
        .order_by(Item.line)
    )
    with db.connect() as conn:
        for row in conn.execution_options(yield_per=_ROWS_PER_FETCH).execute(stmt):
            yield row.line, item_line(job_id, row)


def iter_job_items(db: Engine, job_id: str, *, failed: bool) -> Iterator[tuple[int, bytes]]:
    """``(line, output line)`` for each succeeded (or ``failed``) stored item of the job, by line."""
    status = ItemStatus.failed if failed else ItemStatus.succeeded
    stmt = (
        select(Item.custom_id, Item.line, Item.status, Item.status_code, Item.response, Item.error)
        .where(Item.job_id == job_id, Item.status == status)
        .order_by(Item.line)
    )
    with db.connect() as conn:
        for row in conn.execution_options(yield_per=_ROWS_PER_FETCH).execute(stmt):
            yield row.line, item_line(job_id, row)


def write_shard_parts(db: Engine, job_store: ObjectStore, job_id: str, shard_index: int) -> str:
    """Write a shard's results part file from its stored items; its URI."""
    key = object_keys.part_results_key(shard_index)
    with job_store.open_write(key) as results:
        for _line, data in iter_shard_items(db, job_id, shard_index, failed=False):
            results.write(data)
    return job_store.uri(key)


def iter_lines(stream: BinaryIO) -> Iterator[bytes]:
    with stream:
        yield from stream


def error_line_number(data: bytes) -> int:
    """The input line a line rejected at validation is about (0 when it names none)."""
    err = json.loads(data).get("error") or {}
    line = err.get("line")
    return line if isinstance(line, int) else 0


class ShardSource:
    """Where a shard's output lines come from: results from its part file when written, else
    the DB; failed items from the DB, with their input lines. ``by_line``: the job's shards
    are sets of lines (grouped by prefix), so its output is read by line, job-wide."""

    def __init__(
        self, db: Engine, job_store: ObjectStore, job_id: str, *, by_line: bool = False, invalid_lines: int = 0
    ) -> None:
        self.db, self.job_store, self.job_id, self.by_line = db, job_store, job_id, by_line
        self.invalid_lines = invalid_lines  # lines rejected at validation: ``invalid.jsonl`` must hold them

    @classmethod
    def of_job(cls, db: Engine, job_store: ObjectStore, job_id: str) -> ShardSource:
        with db.connect() as conn:
            row = conn.execute(
                select(Job.shard_order, Job.invalid_requests, Job.num_shards).where(Job.id == job_id)
            ).one_or_none()
        if row is None:
            return cls(db, job_store, job_id)
        # A job stopped before its intake has no shards, only the unrun items of its lines.
        by_line = row.shard_order == "prefix" or not row.num_shards
        return cls(db, job_store, job_id, by_line=by_line, invalid_lines=row.invalid_requests or 0)

    def results(self, shard_index: int, has_parts: bool) -> Iterator[bytes]:
        if has_parts:
            try:
                stream = self.job_store.open_read(object_keys.part_results_key(shard_index))
            except ObjectNotFound:
                pass
            else:
                yield from iter_lines(stream)
                return
        for _line, data in iter_shard_items(self.db, self.job_id, shard_index, failed=False):
            yield data

    def errors(self, shard_index: int) -> Iterator[tuple[int, bytes]]:
        return iter_shard_items(self.db, self.job_id, shard_index, failed=True)


def iter_job_output(
    source: ShardSource,
    shards: Iterable[tuple[int, bool]],
    *,
    errors: bool,
) -> Iterator[bytes]:
    """The job's results (or errors) lines. ``shards``: ``(index, has_parts)`` in index
    order; it may block (``--follow`` waits for each shard to finish; a job read ``by_line``
    yields its first line once every shard has)."""
    if source.by_line:
        for _shard in shards:
            pass
    if not errors:
        if source.by_line:
            yield from (data for _line, data in iter_job_items(source.db, source.job_id, failed=False))
            return
        for index, has_parts in shards:
            yield from source.results(index, has_parts)
        return
    try:
        invalid = iter_lines(source.job_store.open_read(object_keys.INVALID))
    except ObjectNotFound:
        if source.invalid_lines:  # deleted as the job ended: an errors file without them is wrong
            raise ObjectNotFound(
                f"the {source.invalid_lines} lines of job {source.job_id} rejected at validation are gone from "
                f"{source.job_store.uri(object_keys.INVALID)}: the job has ended, and its errors file holds them"
            ) from None
        invalid = iter(())  # (a job cancelled before its intake)
    if source.by_line:
        failed: Iterator[tuple[tuple[int, int], bytes]] = (
            ((line, 1), data) for line, data in iter_job_items(source.db, source.job_id, failed=True)
        )
    else:
        failed = (((line, 1), data) for index, _has_parts in shards for line, data in source.errors(index))
    rejected = (((error_line_number(data), 0), data) for data in invalid)
    for _key, data in heapq.merge(rejected, failed, key=lambda kv: kv[0]):
        yield data


def copy_lines(
    lines: Iterable[bytes], write: Callable[[bytes], Any], on_progress: Callable[[], None] | None = None
) -> int:
    """Write ``lines``; call ``on_progress`` every 1000 lines. Returns the count."""
    count = 0
    for data in lines:
        write(data)
        count += 1
        if on_progress is not None and count % 1000 == 0:
            on_progress()
    return count
