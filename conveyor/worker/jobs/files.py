"""OpenAI Files objects: uploads streamed into the object store, listed and read by owner,
and the output and error files of a batch.

An upload's bytes go to ``files/<file id>/content`` and nowhere else: the user's filename is
only recorded, it never becomes part of a key. ``FileUpload`` writes as the bytes arrive
(a multipart upload on S3), counts them against a size limit and, for a batch input, learns
what the file holds (``conveyor.worker.batchio.batch_scan``) without keeping its lines; the ``files``
row is written only once every byte is stored, so a file that exists is whole.

Every read is scoped by owner (the API key's id; ``None`` for a server without keys): a file
of another owner is "not found", never "forbidden", and never listed. Lists are OpenAI's
cursor pages: ``after`` a file id, newest first unless ``order="asc"``, and ``has_more``.

A batch's results and errors files become files of purpose ``batch_output`` (owned by the
batch's owner) when the batch is finalised (``record_output_files``, called by
``conveyor.worker.jobs.finalize`` in the transaction that ends the job), and only when they hold lines.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, BinaryIO

from sqlalchemy import and_, delete, insert, or_, select, update
from sqlalchemy.engine import Connection, Engine

from conveyor.worker.batchio.batch_scan import BatchScan, BatchScanner
from conveyor.worker.core.limits import MAX_FILENAME_CHARS
from conveyor.worker.core.storable_text import check_storable
from conveyor.worker.jobs.object_keys import is_job_id
from conveyor.worker.store.models import Item, Job, JobStatus, StoredFile, now
from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, ObjectStore, ObjectWriter

_FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")

BATCH, BATCH_OUTPUT, USER_DATA = "batch", "batch_output", "user_data"
# What an upload may be for: a batch's input, or files kept for the user's own use.
UPLOAD_PURPOSES = (BATCH, USER_DATA)
MAX_LIST_LIMIT = 10_000  # OpenAI's, for files (batches: 100)
DEFAULT_LIST_LIMIT = 10_000
# An upload's lifetime when the uploader asks for one (OpenAI's bounds: 1 hour to 30 days).
MIN_EXPIRY_SECONDS, MAX_EXPIRY_SECONDS = 3600, 30 * 24 * 3600
# The key of a job's metrics under which its output files that expired are kept: {file id: expires_at}.
EXPIRED_FILES = "expired_files"


class FileNotFound(LookupError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "file not found"


class FileExpired(FileNotFound):
    """A file past its ``expires_at``: deleted, or about to be (a 404 that says so)."""


class FileTooLarge(ValueError):
    """An upload over the size limit (nothing of it is kept)."""


class FileInUse(RuntimeError):
    """A file a batch still needs (its input, not yet read)."""


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def is_file_id(file_id: object) -> bool:
    return isinstance(file_id, str) and _FILE_ID.match(file_id) is not None


def content_key(file_id: str) -> str:
    if not is_file_id(file_id):
        raise ValueError(f"{file_id!r:.80} is not a file id")
    return f"files/{file_id}/content"


def check_filename(filename: object) -> str:
    """The uploaded file's name as recorded (never used as a path): 1 to 255 characters of
    text without control characters; ``ValueError`` otherwise."""
    if not isinstance(filename, str) or not filename:
        raise ValueError("the file needs a filename")
    if len(filename) > MAX_FILENAME_CHARS:
        raise ValueError(f"the filename is longer than {MAX_FILENAME_CHARS} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in filename) or not _encodable(filename):
        raise ValueError("the filename must be text without control characters")
    return filename


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def file_object(row: Any) -> dict[str, Any]:
    """A ``files`` row as OpenAI's file object (it validates as ``openai.types.FileObject``)."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": int(row.bytes),
        "created_at": int(row.created_at),
        "expires_at": None if row.expires_at is None else int(row.expires_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": row.status,
        "status_details": row.status_details,
    }


def _owned_by(owner: str | None):
    return StoredFile.owner == owner if owner is not None else StoredFile.owner.is_(None)


def _live(t: float):
    return or_(StoredFile.expires_at.is_(None), StoredFile.expires_at > t)


# ---- uploads ----------------------------------------------------------------------------


class FileUpload:
    """One upload under way: ``write`` its bytes as they come, then ``commit`` (the file
    object) or ``abort`` (nothing kept). ``scan_line_bytes``: learn what a batch file holds
    (lines up to that size)."""

    def __init__(self, store: ObjectStore, *, max_bytes: int, scan_line_bytes: int | None = None) -> None:
        self.file_id = new_file_id()
        self.key = content_key(self.file_id)
        self.max_bytes = max_bytes
        self.bytes = 0
        self._store = store
        self._writer: ObjectWriter | None = store.open_write(self.key)
        self._scanner = BatchScanner(scan_line_bytes) if scan_line_bytes is not None else None

    def write(self, data: bytes) -> None:
        """Store ``data``; ``FileTooLarge`` (and the upload aborted) past ``max_bytes``."""
        if self._writer is None:
            raise ValueError("write to a finished upload")
        if self.bytes + len(data) > self.max_bytes:
            self.abort()
            raise FileTooLarge(f"the file is larger than {self.max_bytes} bytes (CONVEYOR_MAX_UPLOAD_BYTES)")
        self.bytes += len(data)
        self._writer.write(data)
        if self._scanner is not None:
            self._scanner.feed(data)

    def stop_scanning(self) -> None:
        """Not a batch file after all (its purpose came after its bytes): learn nothing more."""
        self._scanner = None

    def abort(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.abort()

    def commit(
        self,
        db: Engine,
        *,
        owner: str | None,
        purpose: str,
        filename: str,
        expires_after: int | None = None,
        check: Callable[[Connection], None] | None = None,
    ) -> dict[str, Any]:
        """Finish storing the bytes, then record the file; its file object. ``check`` runs in
        the transaction that records it, first (a quota check: what it raises refuses the
        file, and nothing is kept)."""
        if self._writer is None:
            raise ValueError("commit of a finished upload")
        writer, self._writer = self._writer, None
        scan: BatchScan | None = self._scanner.finish() if self._scanner is not None else None
        try:
            if scan is not None:  # what the lines named is stored with the file, and queried
                check_storable(scan.models, "body.model")
                check_storable(scan.urls, "url")
        except ValueError:
            writer.abort()
            raise
        writer.close()
        t = now()
        values = {
            "id": self.file_id, "owner": owner, "purpose": purpose, "filename": filename, "bytes": self.bytes,
            "uri": self._store.uri(self.key), "status": "processed", "created_at": t,
            "expires_at": None if expires_after is None else t + expires_after,
            "meta": None if scan is None else {"batch": scan.as_meta()},
        }  # fmt: skip
        try:
            with db.begin() as conn:
                if check is not None:
                    check(conn)
                conn.execute(insert(StoredFile).values(**values))
        except BaseException:
            self._store.delete(self.key)
            raise
        return get_file(db, self.file_id, owner)


# ---- reading, listing, deleting --------------------------------------------------------


def _row(conn: Connection, file_id: str, owner: str | None) -> Any:
    if not is_file_id(file_id):
        return None
    return conn.execute(
        select(StoredFile).where(StoredFile.id == file_id, _owned_by(owner), _live(now()))
    ).one_or_none()


@dataclass(frozen=True)
class StoredFileInfo:
    """What the API needs of a file beyond its file object."""

    object: dict[str, Any]
    uri: str
    meta: dict[str, Any] | None
    job_id: str | None

    @property
    def batch_scan(self) -> BatchScan | None:
        scan = (self.meta or {}).get("batch")
        return BatchScan.from_meta(scan) if isinstance(scan, dict) else None


def get_file_info(db: Engine, file_id: str, owner: str | None) -> StoredFileInfo:
    """The file ``file_id`` of ``owner``; ``FileNotFound`` if there is none (or another owns it),
    ``FileExpired`` if it passed its ``expires_at``."""
    with db.connect() as conn:
        row = _row(conn, file_id, owner)
        expired_at = None if row is not None else _expired_at(conn, file_id, owner)
    if expired_at is not None:
        raise FileExpired(f"File {file_id} expired at {expiry_time(expired_at)} (its expires_at) and was deleted.")
    if row is None:
        raise FileNotFound(f"No such File object: {file_id!s:.80}")
    return StoredFileInfo(file_object(row), row.uri, row.metadata, row.job_id)


def _expired_at(conn: Connection, file_id: str, owner: str | None) -> float | None:
    """When ``owner``'s file ``file_id`` expired: its row, if not deleted yet, or what its batch
    recorded when the expired file was deleted (``EXPIRED_FILES`` in the job's metrics)."""
    if not is_file_id(file_id):
        return None
    expires_at = conn.execute(
        select(StoredFile.expires_at).where(StoredFile.id == file_id, _owned_by(owner))
    ).scalar_one_or_none()
    if expires_at is not None:
        return float(expires_at)
    owned = Job.owner == owner if owner is not None else Job.owner.is_(None)
    metrics = conn.execute(
        select(Job.metrics).where(or_(Job.output_file_id == file_id, Job.error_file_id == file_id), owned).limit(1)
    ).scalar_one_or_none()
    gone = (metrics or {}).get(EXPIRED_FILES) or {}
    stamp = gone.get(file_id) if isinstance(gone, dict) else None
    return float(stamp) if isinstance(stamp, (int, float)) else None


def get_file(db: Engine, file_id: str, owner: str | None) -> dict[str, Any]:
    return get_file_info(db, file_id, owner).object


def list_files(
    db: Engine,
    owner: str | None,
    *,
    purpose: str | None = None,
    limit: int = DEFAULT_LIST_LIMIT,
    after: str | None = None,
    order: str = "desc",
) -> dict[str, Any]:
    """OpenAI's list page of ``owner``'s files: ``{object, data, first_id, last_id, has_more}``,
    by creation time (``order``), only those created after file ``after`` in that order."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, got {limit!r:.40}")
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be 'asc' or 'desc', got {order!r:.40}")
    desc = order == "desc"
    check_storable(purpose, "purpose")
    stmt = select(StoredFile).where(_owned_by(owner), _live(now()))
    if purpose is not None:
        stmt = stmt.where(StoredFile.purpose == purpose)
    with db.connect() as conn:
        if after is not None:
            cursor = _row(conn, after, owner)
            if cursor is None:
                raise FileNotFound(f"No such File object: {after!s:.80} (the after cursor)")
            c = cursor
            if desc:
                newer = or_(
                    StoredFile.created_at < c.created_at,
                    and_(StoredFile.created_at == c.created_at, StoredFile.id < c.id),
                )
            else:
                newer = or_(
                    StoredFile.created_at > c.created_at,
                    and_(StoredFile.created_at == c.created_at, StoredFile.id > c.id),
                )
            stmt = stmt.where(newer)
        keys = (StoredFile.created_at.desc(), StoredFile.id.desc()) if desc else (StoredFile.created_at, StoredFile.id)
        rows = list(conn.execute(stmt.order_by(*keys).limit(limit + 1)))
    return list_page([file_object(f) for f in rows[:limit]], has_more=len(rows) > limit)


def list_page(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """OpenAI's list shape."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def open_content(db: Engine, store: ObjectStore, file_id: str, owner: str | None) -> tuple[dict[str, Any], BinaryIO]:
    """The file object and a stream of its bytes; ``FileNotFound`` if either is missing."""
    info = get_file_info(db, file_id, owner)
    try:
        return info.object, store.open_read(store.key_of(info.uri))
    except ObjectNotFound:
        raise FileNotFound(f"the content of file {file_id} is gone from the object store") from None


def iter_chunks(stream: BinaryIO, size: int = 1 << 20) -> Iterator[bytes]:
    with stream:
        while chunk := stream.read(size):
            yield chunk


def delete_file(db: Engine, store: ObjectStore, file_id: str, owner: str | None) -> dict[str, Any]:
    """Delete ``owner``'s file (row, then bytes); OpenAI's deletion object. ``FileInUse`` while
    a batch that has not read its input yet (``validating``) names it."""
    with db.begin() as conn:
        row = _row(conn, file_id, owner)
        if row is None:
            raise FileNotFound(f"No such File object: {file_id!s:.80}")
        pending = conn.execute(
            select(Job.id).where(Job.input_file_id == file_id, Job.status == JobStatus.validating).limit(1)
        ).scalar_one_or_none()
        if pending is not None:
            raise FileInUse(f"file {file_id} is the input of batch {pending}, which has not read it yet")
        conn.execute(delete(StoredFile).where(StoredFile.id == file_id))
        uri = row.uri
    with contextlib.suppress(InvalidKey):  # (an object outside the store is not ours to delete)
        store.delete(store.key_of(uri))
    return {"id": file_id, "object": "file", "deleted": True}


@dataclass(frozen=True)
class ExpiredFiles:
    """What one pass of ``delete_expired_files`` deleted."""

    files: int = 0
    bytes: int = 0


def delete_expired_files(db: Engine, store: ObjectStore, *, limit: int = 100) -> ExpiredFiles:
    """Delete up to ``limit`` files past their ``expires_at``: the row, then the bytes, but only
    under the file's own key (an upload's ``files/<id>/``, a batch output's ``jobs/<job id>/``).
    A batch's output file leaves its expiry in the job's metrics, so a later read says it expired;
    with its last output file go the job's items (the answers the files were made of).
    A batch that has not read its input yet keeps it."""
    with db.connect() as conn:
        ids = list(
            conn.execute(
                select(StoredFile.id)
                .where(StoredFile.expires_at.is_not(None), StoredFile.expires_at <= now())
                .limit(limit)
            ).scalars()
        )
    files = nbytes = 0
    for file_id in ids:
        with db.begin() as conn:
            row = conn.execute(
                select(StoredFile.uri, StoredFile.bytes, StoredFile.job_id, StoredFile.expires_at).where(
                    StoredFile.id == file_id
                )
            ).one_or_none()
            pending = conn.execute(
                select(Job.id).where(Job.input_file_id == file_id, Job.status == JobStatus.validating).limit(1)
            ).scalar_one_or_none()
            if row is None or pending is not None:
                continue
            conn.execute(delete(StoredFile).where(StoredFile.id == file_id))
            if row.job_id is not None:
                _record_expiry(conn, row.job_id, file_id, float(row.expires_at))
                if not conn.execute(select(StoredFile.id).where(StoredFile.job_id == row.job_id).limit(1)).first():
                    # Its last output file: the answers its items hold expire with it.
                    conn.execute(delete(Item).where(Item.job_id == row.job_id))
        with contextlib.suppress(InvalidKey):  # (an object outside the store is not ours to delete)
            key = store.key_of(row.uri)
            if key.startswith(_own_prefix(file_id, row.job_id)):
                store.delete(key)
        files += 1
        nbytes += int(row.bytes)
    return ExpiredFiles(files, nbytes)


def _own_prefix(file_id: str, job_id: str | None) -> str:
    return f"jobs/{job_id}/" if job_id is not None and is_job_id(job_id) else f"files/{file_id}/"


def outputs_expired_at(job_metrics: dict[str, Any] | None) -> float | None:
    """When a job's output files expired and were deleted (the first of them), from its
    metrics; None if none has."""
    gone = (job_metrics or {}).get(EXPIRED_FILES)
    stamps = [float(t) for t in gone.values() if isinstance(t, (int, float))] if isinstance(gone, dict) else []
    return min(stamps, default=None)


def expiry_time(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _record_expiry(conn: Connection, job_id: str, file_id: str, expires_at: float) -> None:
    metrics = conn.execute(select(Job.metrics).where(Job.id == job_id).with_for_update()).scalar_one_or_none()
    metrics = dict(metrics or {})
    metrics[EXPIRED_FILES] = {**(metrics.get(EXPIRED_FILES) or {}), file_id: expires_at}
    conn.execute(update(Job).where(Job.id == job_id).values(metrics=metrics))


# ---- a batch's output files ---------------------------------------------------------------


@dataclass(frozen=True)
class OutputFile:
    uri: str
    bytes: int
    lines: int


def record_output_files(
    conn: Connection,
    job_id: str,
    owner: str | None,
    results: OutputFile,
    errors: OutputFile,
    *,
    expires_after: int | None = None,
) -> dict[str, str | None]:
    """Within the transaction that ends job ``job_id``: a ``batch_output`` file for its results
    and one for its errors, each only if it holds lines, and the job's ``output_file_id`` and
    ``error_file_id`` set to them. ``expires_after``: each file's ``expires_at`` is its
    ``created_at`` plus that many seconds (OpenAI's anchor is the file's creation)."""
    t = now()
    expires_at = None if expires_after is None else t + expires_after
    ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
    for column, out, name in (("output_file_id", results, "output"), ("error_file_id", errors, "error")):
        if not out.lines:
            continue
        file_id = new_file_id()
        conn.execute(
            insert(StoredFile).values(
                id=file_id, owner=owner, purpose=BATCH_OUTPUT, filename=f"{job_id}_{name}.jsonl",
                bytes=out.bytes, uri=out.uri, status="processed", job_id=job_id, created_at=t,
                expires_at=expires_at,
            )
        )  # fmt: skip
        ids[column] = file_id
    conn.execute(update(Job).where(Job.id == job_id).values(**ids))
    return ids
