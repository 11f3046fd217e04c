"""``POST /v1/files``'s body, streamed: a multipart form parsed as it arrives, its ``file`` part
written to the object store as it comes, nothing of it spooled to memory or disk.

``request.stream()`` feeds ``python_multipart``'s push parser; the parser's callbacks only
record what they saw (a part began, bytes of it, it ended), and this coroutine acts on that
in order between two network reads. The file's bytes are gathered into writes of about
``FLUSH_BYTES`` and handed to a thread (``FileUpload.write``: the object store's calls
block), so the server holds at most about one flush plus one network read per upload, and
the store's own part buffer (``CONVEYOR_MULTIPART_PART_BYTES`` on S3).

Over ``CONVEYOR_MAX_UPLOAD_BYTES`` (told by ``Content-Length`` before anything is read, or
counted while streaming) the upload is aborted, nothing of it is kept, and the answer is 413.
Before any early answer the rest of the body is read and dropped (up to ``DRAIN_BYTES``), so
that the client, still sending, reads the answer rather than a reset connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from conveyor.worker.api.errors import ApiError, bad_request
from conveyor.worker.jobs.files import (
    BATCH,
    MAX_EXPIRY_SECONDS,
    MIN_EXPIRY_SECONDS,
    UPLOAD_PURPOSES,
    FileTooLarge,
    FileUpload,
    check_filename,
)
from conveyor.worker.store.objects.base import ObjectStore

FLUSH_BYTES = 1 << 20
DRAIN_BYTES = 64 << 20
MAX_FIELD_BYTES = 64  # a form field other than the file (purpose, expires_after[...])
MAX_FIELDS = 8
MAX_PARTS = 16  # parts of any name (a million empty parts must not be read through one by one)
MAX_HEADER_BYTES = 8192  # all the headers of one part
MULTIPART_OVERHEAD = 64 << 10  # room in Content-Length for the form around the file


@dataclass
class _Part:
    headers: list[tuple[bytearray, bytearray]] = field(default_factory=list)
    header_bytes: int = 0
    name: str | None = None
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


class _Events:
    """What the parser's callbacks saw during one ``write``, in order."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []
        self.part = _Part()

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._begin,
            "on_header_field": self._field,
            "on_header_value": self._value,
            "on_headers_finished": self._headers_done,
            "on_part_data": self._data,
            "on_part_end": lambda: self.items.append(("end", None)),
            "on_end": lambda: self.items.append(("done", None)),
        }

    def _begin(self) -> None:
        self.part = _Part()

    def _count(self, n: int) -> None:
        self.part.header_bytes += n
        if self.part.header_bytes > MAX_HEADER_BYTES:
            raise bad_request(f"a part of the form has more than {MAX_HEADER_BYTES} bytes of headers")

    def _field(self, data: bytes, start: int, end: int) -> None:
        self._count(end - start)
        if not self.part.headers or self.part.headers[-1][1]:
            self.part.headers.append((bytearray(), bytearray()))
        self.part.headers[-1][0].extend(data[start:end])

    def _value(self, data: bytes, start: int, end: int) -> None:
        self._count(end - start)
        if not self.part.headers:
            self.part.headers.append((bytearray(), bytearray()))
        self.part.headers[-1][1].extend(data[start:end])

    def _headers_done(self) -> None:
        for name, value in self.part.headers:
            if bytes(name).strip().lower() == b"content-disposition":
                _kind, options = parse_options_header(bytes(value))
                if b"name" in options:
                    self.part.name = options[b"name"].decode("utf-8", "replace")
                if b"filename" in options:
                    self.part.filename = options[b"filename"].decode("utf-8", "replace")
        self.items.append(("begin", self.part))

    def _data(self, data: bytes, start: int, end: int) -> None:
        if end > start:
            self.items.append(("data", data[start:end]))


@dataclass
class UploadForm:
    """What the form held besides the file's bytes."""

    purpose: str
    filename: str
    expires_after: int | None


@dataclass(frozen=True)
class Pace:
    """How slow an upload may be: no gap over ``idle_seconds``; once it has run that long, an
    average of at least ``min_bytes_per_second``; ``max_seconds`` in all."""

    idle_seconds: float
    min_bytes_per_second: int = 0
    max_seconds: float = float("inf")


class UploadStalled(Exception):
    """The client sent too slowly (the message says how) in the middle of a body."""


async def _paced(stream: AsyncIterator[bytes], pace: Pace) -> AsyncIterator[bytes]:
    """``stream``'s chunks at ``pace``: a client that stops sending mid-body, or trickles a
    byte every few seconds (a dead peer, a slow-loris), does not hold an upload slot."""
    chunks = stream.__aiter__()
    loop = asyncio.get_running_loop()
    start, seen = loop.time(), 0
    while True:
        left = start + pace.max_seconds - loop.time()
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), min(pace.idle_seconds, max(left, 0.0)))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            if left <= pace.idle_seconds:
                raise UploadStalled(f"it took over {pace.max_seconds:.0f} s (CONVEYOR_UPLOAD_MAX_SECONDS)") from None
            raise UploadStalled(
                f"no data for {pace.idle_seconds:.0f} s (CONVEYOR_UPLOAD_IDLE_TIMEOUT_SECONDS)"
            ) from None
        seen += len(chunk)
        elapsed = loop.time() - start
        if elapsed >= pace.idle_seconds and seen < pace.min_bytes_per_second * elapsed:
            raise UploadStalled(
                f"{seen / elapsed:.0f} bytes/s on average, under {pace.min_bytes_per_second} "
                "(CONVEYOR_UPLOAD_MIN_BYTES_PER_SECOND)"
            )
        yield chunk


async def drain(stream: AsyncIterator[bytes], limit: int = DRAIN_BYTES) -> None:
    """Read and drop the rest of a body (up to ``limit`` bytes) before an early answer."""
    seen = 0
    try:
        async for chunk in stream:
            seen += len(chunk)
            if seen > limit:
                return
    except ClientDisconnect:
        return


def _boundary(request: Request) -> bytes:
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise bad_request(
            "Uploads are multipart/form-data with a 'file' part and a 'purpose' field.", code="invalid_content_type"
        )
    return boundary


def too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"The file is larger than the server's upload limit of {max_bytes} bytes (CONVEYOR_MAX_UPLOAD_BYTES).",
        code="file_too_large",
        headers={"Connection": "close"},
    )


def check_declared_length(request: Request, max_bytes: int) -> None:
    """413 at once when ``Content-Length`` already says the body is over the limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes + MULTIPART_OVERHEAD:
        raise too_large(max_bytes)


async def receive_upload(
    request: Request, store: ObjectStore, *, max_bytes: int, max_line_bytes: int, pace: Pace
) -> tuple[FileUpload, UploadForm]:
    """Stream the form's file into the store; the upload (to ``commit``) and the form's fields.
    An ``ApiError`` after the upload was aborted and the body drained (a 408, not drained,
    when the client sent slower than ``pace``)."""
    form = _FormReader(_boundary(request), store, max_bytes=max_bytes, max_line_bytes=max_line_bytes)
    stream = _paced(request.stream(), pace)
    try:
        async for chunk in stream:
            await form.feed(chunk)
        return form.finish()
    except ClientDisconnect:
        await form.abort()
        raise ApiError(400, "The client went away before the upload finished.") from None
    except FileTooLarge:
        await drain(stream)
        raise too_large(max_bytes) from None
    except UploadStalled as exc:
        await form.abort()
        raise ApiError(
            408,
            f"The upload was too slow: {exc}; nothing was kept.",
            code="upload_timeout",
            headers={"Connection": "close"},
        ) from None
    except BaseException:
        await form.abort()
        await drain(stream)
        raise


class _FormReader:
    """A multipart form read as it streams in: its file part goes to the store (``FLUSH_BYTES``
    at a time), its other fields are kept, bounded in number and size."""

    def __init__(self, boundary: bytes, store: ObjectStore, *, max_bytes: int, max_line_bytes: int) -> None:
        self.events = _Events()
        self.parser = MultipartParser(boundary, self.events.callbacks())
        self.store = store
        self.max_bytes = max_bytes
        self.max_line_bytes = max_line_bytes
        self.upload: FileUpload | None = None
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.pending = bytearray()
        self.current: _Part | None = None
        self.parts = 0
        self.done = False

    async def feed(self, chunk: bytes) -> None:
        try:
            self.parser.write(chunk)
        except MultipartParseError as exc:
            raise bad_request(f"The multipart body could not be parsed: {exc}") from None
        for kind, value in self.events.items:
            if kind == "begin":
                await self._begin(value)
            elif kind == "data" and self.current is not None:
                await self._data(self.current, value)
            elif kind == "end" and self.current is not None:
                await self._end(self.current)
            elif kind == "done":
                self.done = True
        self.events.items.clear()

    async def _begin(self, part: _Part) -> None:
        self.current = part
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise bad_request(f"The form has more than {MAX_PARTS} parts.")
        if part.name == "file":
            if self.upload is not None:
                raise bad_request("The form holds more than one file.", param="file")
            self.filename = _filename(part.filename)
            scan = self.max_line_bytes if self.fields.get("purpose", BATCH) == BATCH else None
            self.upload = await run_in_threadpool(
                FileUpload, self.store, max_bytes=self.max_bytes, scan_line_bytes=scan
            )
        elif len(self.fields) >= MAX_FIELDS:
            raise bad_request(f"The form has more than {MAX_FIELDS} fields.")

    async def _data(self, part: _Part, value: bytes) -> None:
        if part.name == "file" and self.upload is not None:
            self.pending += value
            if len(self.pending) >= FLUSH_BYTES:
                await run_in_threadpool(self.upload.write, bytes(self.pending))
                self.pending.clear()
        else:
            part.value += value
            if len(part.value) > MAX_FIELD_BYTES:
                raise bad_request(f"The form field {part.name!r:.40} is too long.", param=part.name)

    async def _end(self, part: _Part) -> None:
        if part.name == "file" and self.upload is not None:
            await run_in_threadpool(self.upload.write, bytes(self.pending))
            self.pending.clear()
        elif part.name is not None:
            self.fields[part.name] = part.value.decode("utf-8", "replace")
        self.current = None

    def finish(self) -> tuple[FileUpload, UploadForm]:
        """The upload and the form, once the whole body was read."""
        if not self.done:
            raise bad_request("The multipart body ended early.")
        if self.upload is None:
            raise bad_request("Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
        form = _form(self.fields, self.filename or "")
        if form.purpose != BATCH:
            self.upload.stop_scanning()
        return self.upload, form

    async def abort(self) -> None:
        """Drop what was stored of the file (the upload failed)."""
        if self.upload is not None:
            await run_in_threadpool(self.upload.abort)


def _filename(name: str | None) -> str:
    try:
        return check_filename(name)
    except ValueError as exc:
        raise bad_request(f"Invalid filename: {exc}.", param="file") from None


def _form(fields: dict[str, str], filename: str) -> UploadForm:
    purpose = fields.get("purpose")
    if purpose is None:
        raise bad_request("Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter")
    if purpose not in UPLOAD_PURPOSES:
        raise bad_request(
            f"Invalid value for 'purpose': {purpose!r:.40}; Conveyor takes {' or '.join(map(repr, UPLOAD_PURPOSES))}.",
            param="purpose",
            code="invalid_value",
        )
    expires_after = None
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is not None or seconds is not None:
        if anchor != "created_at":
            raise bad_request(
                "Invalid value for 'expires_after.anchor': it must be 'created_at'.", param="expires_after.anchor"
            )
        if seconds is None or not seconds.isdigit() or not MIN_EXPIRY_SECONDS <= int(seconds) <= MAX_EXPIRY_SECONDS:
            raise bad_request(
                f"Invalid value for 'expires_after.seconds': it must be an integer from {MIN_EXPIRY_SECONDS} "
                f"to {MAX_EXPIRY_SECONDS}.",
                param="expires_after.seconds",
            )
        expires_after = int(seconds)
    return UploadForm(purpose, filename, expires_after)
