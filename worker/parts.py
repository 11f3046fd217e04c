"""Stored items as output lines: a shard's part files, and the job's results/errors streams.

Lines are built from the database rows, so a shard that ran twice (redelivery, takeover)
still yields each item once, byte-identical whoever writes it. A shard's part files hold
its items in input-line order; the job's results file is the parts in shard order (shards
are consecutive line ranges, so that is input order), and its errors file merges the
lines rejected at validation with the failed items, by line number.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.engine import Engine

from worker import keys
from worker.batch_output import dumps_line, error_line, output_line
from worker.store.db import Item, ItemStatus
from worker.store.objects import ObjectNotFound, ObjectStore

_ROWS_PER_FETCH = 1000


def item_line(job_id: str, row: Any) -> bytes:
    """The results-file (succeeded) or errors-file (failed) line of a stored item."""
    if ItemStatus(row.status) is ItemStatus.succeeded:
        return dumps_line(output_line(job_id, row.custom_id, row.response or {}, row.status_code))
    err = row.error or {}
    return dumps_line(
        error_line(
            job_id,
            row.custom_id,
            code=str(err.get("code") or "error"),
            message=str(err.get("message") or ""),
            line=row.line,
            param=err.get("param"),
            status_code=row.status_code,
        )
    )


def iter_shard_items(db: Engine, job_id: str, shard_index: int) -> Iterator[tuple[bool, int, bytes]]:
    """``(succeeded, line, output line)`` for each stored item of a shard, by input line."""
    stmt = (
        select(Item.custom_id, Item.line, Item.status, Item.status_code, Item.response, Item.error)
        .where(Item.job_id == job_id, Item.shard_index == shard_index)
        .order_by(Item.line)
    )
    with db.connect() as conn:
        for row in conn.execution_options(yield_per=_ROWS_PER_FETCH).execute(stmt):
            ok = ItemStatus(row.status) is ItemStatus.succeeded
            yield ok, row.line, item_line(job_id, row)


def write_shard_parts(db: Engine, job_store: ObjectStore, job_id: str, shard_index: int) -> tuple[str, str]:
    """Write a shard's results and errors part files from its stored items; their URIs."""
    results_key, errors_key = keys.part_results_key(shard_index), keys.part_errors_key(shard_index)
    with job_store.open_write(results_key) as results, job_store.open_write(errors_key) as errors:
        for ok, _line, data in iter_shard_items(db, job_id, shard_index):
            (results if ok else errors).write(data)
    return job_store.uri(results_key), job_store.uri(errors_key)


def iter_lines(stream: BinaryIO) -> Iterator[bytes]:
    with stream:
        yield from stream


def error_line_number(data: bytes) -> int:
    """The input line an errors-file line is about (0 when it names none)."""
    err = json.loads(data).get("error") or {}
    line = err.get("line")
    return line if isinstance(line, int) else 0


class ShardSource:
    """Where a shard's output lines come from: its part file when written, else the DB."""

    def __init__(self, db: Engine, job_store: ObjectStore, job_id: str) -> None:
        self.db, self.job_store, self.job_id = db, job_store, job_id

    def lines(self, shard_index: int, has_parts: bool, *, errors: bool) -> Iterator[bytes]:
        if has_parts:
            key = keys.part_errors_key(shard_index) if errors else keys.part_results_key(shard_index)
            try:
                stream = self.job_store.open_read(key)
            except ObjectNotFound:
                pass
            else:
                yield from iter_lines(stream)
                return
        for ok, _line, data in iter_shard_items(self.db, self.job_id, shard_index):
            if ok != errors:
                yield data


def iter_job_output(
    source: ShardSource,
    shards: Iterable[tuple[int, bool]],
    *,
    errors: bool,
) -> Iterator[bytes]:
    """The job's results (or errors) lines. ``shards``: ``(index, has_parts)`` in index
    order; it may block (``--follow`` waits for each shard to finish)."""
    per_shard = (line for index, has_parts in shards for line in source.lines(index, has_parts, errors=errors))
    if not errors:
        yield from per_shard
        return
    try:
        invalid = iter_lines(source.job_store.open_read(keys.INVALID))
    except ObjectNotFound:
        invalid = iter(())
    keyed = (((error_line_number(d), 0), d) for d in invalid), (((error_line_number(d), 1), d) for d in per_shard)
    for _key, data in heapq.merge(*keyed, key=lambda kv: kv[0]):
        yield data


def copy_lines(lines: Iterable[bytes], write: Callable[[bytes], Any], on_progress: Callable[[], None] | None = None) -> int:
    """Write ``lines``; call ``on_progress`` every 1000 lines. Returns the count."""
    count = 0
    for data in lines:
        write(data)
        count += 1
        if on_progress is not None and count % 1000 == 0:
            on_progress()
    return count
