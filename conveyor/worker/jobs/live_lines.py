"""A running job's results (or errors) lines as each item is stored: ``conveyor results
--follow``.

Items reach the database one by one as they finish (batched commits), so the follower polls
the job's items, not its shards: a one-shard job's lines come out while it runs.

- ``input`` order yields the lines exactly as the job's file will hold them, each as soon as
  every line before it is stored: the valid lines of the job are listed by its shard input
  files, and the follower passes a line once its item is there. Lines rejected at validation
  (``invalid.jsonl``) join the errors stream at their place.
- ``completion`` order yields each line once its item is stored, keyed by the line's ``id``.
  Items are read by ``finished_at`` with a margin, since a batch of items commits a little
  after they finish.

When the job ends, the rest comes from its finished file (``final_lines``): in input order
the lines after those already yielded (they are its prefix, byte for byte), in completion
order the lines not yielded yet. So no line is lost or repeated, even when the job's working
objects are deleted while it is followed.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.engine import Engine

from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.output_files import error_line_number, item_line, iter_lines
from conveyor.worker.store.models import Item, ItemStatus, Job, JobStatus, Shard
from conveyor.worker.store.objects.base import ObjectNotFound, ObjectStore

_ROWS_PER_QUERY = 1000
# Items commit in batches after they finish (and a commit may wait out a short outage): a
# completion-order poll looks this far back before its newest item.
COMMIT_MARGIN_SECONDS = 30.0


class Order(str, enum.Enum):
    input = "input"
    completion = "completion"


class IntakeFailed(RuntimeError):
    """The followed job failed while its input was taken in: it has no lines."""


@dataclass(frozen=True)
class FollowState:
    """What a poll found: lines yielded so far and the job's shards (0 while in intake)."""

    written: int
    num_shards: int


@dataclass(frozen=True)
class FollowTarget:
    db: Engine
    job_store: ObjectStore
    job_id: str
    errors: bool


_COLUMNS = (Item.custom_id, Item.line, Item.status, Item.status_code, Item.response, Item.error)


def follow_lines(
    target: FollowTarget,
    final_lines: Callable[[], Iterator[bytes]],
    *,
    order: Order = Order.input,
    poll: float = 0.5,
    on_poll: Callable[[FollowState], None] | None = None,
) -> Iterator[bytes]:
    """The job's lines as they are stored, then the rest from ``final_lines()`` (the ended
    job's file) once it ends. ``on_poll`` is called at each wait."""
    stream: _Stream | None = None
    written = 0
    seen: set[str] = set()
    while True:
        num_shards, status, by_line = _job_state(target)
        if status.terminal:
            break
        if stream is None and num_shards and status is not JobStatus.validating:
            stream = _InputOrder(target, by_line) if order is Order.input else _CompletionOrder(target)
        if stream is not None:
            try:
                for data in stream.step():
                    if order is Order.completion:
                        seen.add(_line_id(data))
                    written += 1
                    yield data
            except ObjectNotFound:  # the job ended meanwhile and its working objects went
                break
        if on_poll is not None:
            on_poll(FollowState(written, num_shards))
        time.sleep(poll)
    if order is Order.input:
        yield from itertools.islice(final_lines(), written, None)
        return
    for data in final_lines():
        if _line_id(data) not in seen:
            yield data


def _job_state(target: FollowTarget) -> tuple[int, JobStatus, bool]:
    with target.db.connect() as conn:
        num, status, shard_order = conn.execute(
            select(Job.num_shards, Job.status, Job.shard_order).where(Job.id == target.job_id)
        ).one()
    status = JobStatus(status)
    if status is JobStatus.failed and not num:
        raise IntakeFailed(f"job {target.job_id} failed during intake: conveyor status {target.job_id} says why")
    return num, status, shard_order == "prefix"


def _line_id(data: bytes) -> str:
    return str(json.loads(data)["id"])


class _Stream(Protocol):
    def step(self) -> Iterator[bytes]:
        """The lines that became ready since the last step."""
        ...


@dataclass
class _InputOrder:
    """Lines in input order: the watermark moves past each valid line once its item is stored."""

    target: FollowTarget
    by_line: bool
    cursor: int = 0  # every valid line up to here is stored and its output yielded
    _expected: Iterator[int] | None = None
    _next: int | None = None
    _rejected: Iterator[tuple[int, bytes]] | None = None
    _rejected_next: tuple[int, bytes] | None = None

    def step(self) -> Iterator[bytes]:
        if self._expected is None:
            self._expected = self._valid_lines()
            self._next = next(self._expected, None)
            if self.target.errors:
                self._rejected = self._read_rejected()
                self._rejected_next = next(self._rejected, None)
        wanted = ItemStatus.failed if self.target.errors else ItemStatus.succeeded
        while self._next is not None:
            # The stored lines first (small rows): how far the watermark moves; then the
            # output of those passed, in one read.
            lines = select(Item.line).where(Item.job_id == self.target.job_id, Item.line > self.cursor)
            with self.target.db.connect() as conn:
                stored = conn.execute(lines.order_by(Item.line).limit(_ROWS_PER_QUERY)).scalars().all()
            end = self.cursor
            for line in stored:
                if line != self._next:
                    break  # a line before it is still running
                end = line
                self._next = next(self._expected, None)
            if end == self.cursor:
                break
            stmt = (
                select(*_COLUMNS)
                .where(Item.job_id == self.target.job_id, Item.line > self.cursor, Item.line <= end)
                .where(Item.status == wanted)
                .order_by(Item.line)
            )
            with self.target.db.connect() as conn:
                rows = conn.execute(stmt).all()
            self.cursor = end
            for row in rows:
                yield from self._rejected_before(row.line)
                yield item_line(self.target.job_id, row)
            if len(stored) < _ROWS_PER_QUERY:
                break
        yield from self._rejected_before(self._next)

    def _rejected_before(self, line: int | None) -> Iterator[bytes]:
        """Rejected lines before ``line`` (all of them when None)."""
        while self._rejected_next is not None and (line is None or self._rejected_next[0] < line):
            yield self._rejected_next[1]
            self._rejected_next = next(self._rejected, None) if self._rejected is not None else None

    def _read_rejected(self) -> Iterator[tuple[int, bytes]]:
        store = self.target.job_store
        try:
            stream = store.open_read(object_keys.INVALID)
        except ObjectNotFound:
            with self.target.db.connect() as conn:
                invalid = conn.execute(select(Job.invalid_requests).where(Job.id == self.target.job_id)).scalar_one()
            if invalid:
                raise  # deleted as the job ended: the follower reads its errors file instead
            return iter(())
        return ((error_line_number(data), data) for data in iter_lines(stream))

    def _shard_lines(self, index: int) -> list[int]:
        stream = self.target.job_store.open_read(object_keys.shard_input_key(index))
        return sorted(json.loads(data)["line"] for data in iter_lines(stream) if data.strip())

    def _valid_lines(self) -> Iterator[int]:
        """Every valid input line of the job, in order. Shards cut in input order are runs of
        lines, read one at a time as the watermark reaches them; shards grouped by prefix
        interleave, so all are read first."""
        with self.target.db.connect() as conn:
            indexes = list(
                conn.execute(
                    select(Shard.shard_index).where(Shard.job_id == self.target.job_id).order_by(Shard.shard_index)
                ).scalars()
            )
        if self.by_line:
            return heapq.merge(*(self._shard_lines(i) for i in indexes))
        return (line for index in indexes for line in self._shard_lines(index))


@dataclass
class _CompletionOrder:
    """Lines as their items are stored, whatever their place in the input."""

    target: FollowTarget
    newest: float = 0.0
    _yielded: set[str] = field(default_factory=set)
    _rejected_done: bool = False

    def step(self) -> Iterator[bytes]:
        if self.target.errors and not self._rejected_done:
            # None, or the job ended: then its errors file has them, and the follower reads it.
            with contextlib.suppress(ObjectNotFound):
                yield from iter_lines(self.target.job_store.open_read(object_keys.INVALID))
            self._rejected_done = True
        status = ItemStatus.failed if self.target.errors else ItemStatus.succeeded
        recent = (
            select(Item.custom_id, Item.finished_at)
            .where(
                Item.job_id == self.target.job_id,
                Item.status == status,
                Item.finished_at >= self.newest - COMMIT_MARGIN_SECONDS,
            )
            .order_by(Item.finished_at, Item.line)
        )
        with self.target.db.connect() as conn:
            fresh = [r for r in conn.execute(recent) if r.custom_id not in self._yielded]
        for start in range(0, len(fresh), _ROWS_PER_QUERY):
            chunk = fresh[start : start + _ROWS_PER_QUERY]
            stmt = select(*_COLUMNS).where(
                Item.job_id == self.target.job_id, Item.custom_id.in_([r.custom_id for r in chunk])
            )
            with self.target.db.connect() as conn:
                rows = {row.custom_id: row for row in conn.execute(stmt)}
            for r in chunk:
                self._yielded.add(r.custom_id)
                self.newest = max(self.newest, r.finished_at)
                yield item_line(self.target.job_id, rows[r.custom_id])
