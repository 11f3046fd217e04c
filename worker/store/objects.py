"""One object-storage interface over S3 (boto3) and a local directory.

``open_store(url)`` gives the root store (``s3://bucket/prefix`` or ``file:///dir`` or a
plain path); ``store.scoped("jobs/<id>")`` gives a store whose keys are relative to that
prefix. Every key is validated: relative, ``/``-separated, no ``.``/``..`` segments, no
backslashes or control characters, so a key can never escape its prefix.

Reads stream (``open_read`` returns a buffered binary file); writes stream too:
``open_write`` returns a writer that uploads in parts of ``part_size`` bytes (S3 multipart
upload), so memory stays bounded whatever the object's size. A writer commits on
``close()`` (or leaving its ``with`` block normally) and leaves nothing behind on
``abort()`` (or an exception in the block).
"""

from __future__ import annotations

import io
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

from worker.settings import Settings, redact_url

MiB = 1024 * 1024
S3_MIN_PART = 5 * MiB
MAX_KEY_BYTES = 1024  # S3's limit on a full key
_TMP_MARK = ".conveyor-tmp-"


class InvalidKey(ValueError):
    """A key that is empty, absolute, or could escape its prefix."""


class ObjectNotFound(KeyError):
    """No object under that key."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "object not found"


class ObjectTooLarge(ValueError):
    """An object is bigger than the caller allowed."""


def _check_chars(text: str, what: str) -> None:
    if "\\" in text:
        raise InvalidKey(f"{what} {text!r} contains a backslash; use '/' to separate parts")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise InvalidKey(f"{what} {text!r} contains a control character")
    if len(text.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidKey(f"{what} is longer than {MAX_KEY_BYTES} bytes")


def validate_key(key: str) -> str:
    """``key`` unchanged if it is a safe relative key, else ``InvalidKey`` saying why."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"an object key must be a non-empty string, got {key!r}")
    _check_chars(key, "key")
    if key.startswith("/"):
        raise InvalidKey(f"key {key!r} is absolute; keys are relative to the store's prefix")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidKey(f"key {key!r} has an empty, '.' or '..' segment")
    return key


def validate_prefix(prefix: str) -> str:
    """A listing prefix: like a key, but may be empty, end with '/' or stop mid-segment."""
    if prefix == "":
        return prefix
    validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


class ObjectWriter(ABC):
    """A streamed upload: ``write`` bytes, then ``close`` commits or ``abort`` discards."""

    def __init__(self) -> None:
        self.bytes_written = 0
        self._done = False

    def write(self, data: bytes) -> int:
        if self._done:
            raise ValueError("write to a closed object writer")
        self._write(data)
        self.bytes_written += len(data)
        return len(data)

    def close(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._commit()
            except BaseException:
                self._abort()
                raise

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._abort()

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @abstractmethod
    def _write(self, data: bytes) -> None: ...

    @abstractmethod
    def _commit(self) -> None: ...

    @abstractmethod
    def _abort(self) -> None: ...


class ObjectStore(ABC):
    """Keys are relative to this store's prefix (see ``scoped``)."""

    @abstractmethod
    def uri(self, key: str = "") -> str:
        """A URI naming the object (or the store's prefix), for people and the job record."""

    @abstractmethod
    def scoped(self, prefix: str) -> ObjectStore:
        """A store for the keys under ``prefix`` (relative to this one)."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """A buffered binary stream of the object (``ObjectNotFound`` if missing)."""

    @abstractmethod
    def open_write(self, key: str) -> ObjectWriter: ...

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys that start with ``prefix``, in lexicographic order."""

    @abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes (``ObjectNotFound`` if missing)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing key is not an error."""

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def get_bytes(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The whole object; ``ObjectTooLarge`` if it exceeds ``max_bytes``."""
        with self.open_read(key) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise ObjectTooLarge(f"object {self.uri(key)} is larger than {max_bytes} bytes")
        return data


# ---- local directory ----------------------------------------------------------------------


class _LocalWriter(ObjectWriter):
    def __init__(self, target: Path) -> None:
        super().__init__()
        target.parent.mkdir(parents=True, exist_ok=True)
        self._target = target
        self._tmp = target.with_name(f"{_TMP_MARK}{uuid.uuid4().hex}-{target.name}")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in commit/abort)

    def _write(self, data: bytes) -> None:
        self._file.write(data)

    def _commit(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self._target)

    def _abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


class LocalStore(ObjectStore):
    """Objects as files under a root directory (created on first write)."""

    def __init__(self, root: str | os.PathLike[str], prefix: str = "") -> None:
        self.root = Path(root).expanduser().resolve()
        self.prefix = validate_key(prefix) if prefix else ""

    def _base(self) -> Path:
        return self.root / self.prefix if self.prefix else self.root

    def _path(self, key: str) -> Path:
        path = self._base() / validate_key(key)
        # Keys are checked lexically; this also stops a symlink inside the store leading out.
        if not path.resolve().is_relative_to(self.root):
            raise InvalidKey(f"key {key!r} resolves outside the store at {self.root}")
        return path

    def uri(self, key: str = "") -> str:
        return (self._path(key) if key else self._base()).as_uri()

    def scoped(self, prefix: str) -> LocalStore:
        validate_key(prefix)
        return LocalStore(self.root, f"{self.prefix}/{prefix}" if self.prefix else prefix)

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.open_write(key) as w:
            w.write(data)

    def open_read(self, key: str) -> BinaryIO:
        path = self._path(key)
        try:
            return open(path, "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"no object {path.as_uri()}") from None

    def open_write(self, key: str) -> ObjectWriter:
        return _LocalWriter(self._path(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        base = self._base()
        if not base.is_dir():
            return iter(())
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            rel_dir = Path(dirpath).relative_to(base).as_posix()
            for name in files:
                if name.startswith(_TMP_MARK):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return iter(sorted(keys))

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(f"no object {path.as_uri()}")
        return path.stat().st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


# ---- S3 -----------------------------------------------------------------------------------


class _RawBody(io.RawIOBase):
    """botocore's StreamingBody as a raw stream, so io.BufferedReader can wrap it."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


class _S3Writer(ObjectWriter):
    """Buffers at most ``part_size`` bytes; one PUT if small, else a multipart upload."""

    def __init__(self, client: Any, bucket: str, key: str, part_size: int) -> None:
        super().__init__()
        self._client, self._bucket, self._key, self._part_size = client, bucket, key, part_size
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self.max_buffered = 0  # the most bytes held at once (tests check the bound)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self._part_size - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            self.max_buffered = max(self.max_buffered, len(self._buf))
            if len(self._buf) >= self._part_size:
                self._upload_part()

    def _upload_part(self) -> None:
        if self._upload_id is None:
            resp = self._client.create_multipart_upload(Bucket=self._bucket, Key=self._key)
            self._upload_id = resp["UploadId"]
        number = len(self._parts) + 1
        resp = self._client.upload_part(
            Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=bytes(self._buf)
        )
        self._parts.append({"PartNumber": number, "ETag": resp["ETag"]})
        self._buf.clear()

    def _commit(self) -> None:
        if self._upload_id is None:
            self._client.put_object(Bucket=self._bucket, Key=self._key, Body=bytes(self._buf))
            return
        if self._buf:
            self._upload_part()
        self._client.complete_multipart_upload(
            Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload={"Parts": self._parts}
        )

    def _abort(self) -> None:
        self._buf.clear()
        if self._upload_id is not None:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)


def _is_not_found(exc: Exception) -> bool:
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


class S3Store(ObjectStore):
    """Objects in an S3 (or S3-compatible) bucket under ``prefix``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        endpoint_url: str | None = None,
        part_size: int = 8 * MiB,
    ) -> None:
        if not bucket:
            raise ValueError("an S3 store needs a bucket name (s3://bucket/prefix)")
        if part_size < S3_MIN_PART:
            raise ValueError(f"part_size must be at least {S3_MIN_PART} bytes (S3's minimum part), got {part_size}")
        self.bucket = bucket
        self.prefix = validate_key(prefix) if prefix else ""
        self.part_size = part_size
        self._client = client if client is not None else _make_client(endpoint_url)

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str = "") -> str:
        path = self._full(key) if key else self.prefix
        return f"s3://{self.bucket}/{path}" if path else f"s3://{self.bucket}"

    def scoped(self, prefix: str) -> S3Store:
        return S3Store(self.bucket, self._full(prefix), client=self._client, part_size=self.part_size)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data)

    def open_read(self, key: str) -> BinaryIO:
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key))
        except Exception as exc:
            if _is_not_found(exc):
                raise ObjectNotFound(f"no object {self.uri(key)}") from None
            raise
        return io.BufferedReader(_RawBody(resp["Body"]), buffer_size=1 * MiB)  # type: ignore[return-value]

    def open_write(self, key: str) -> ObjectWriter:
        return _S3Writer(self._client, self.bucket, self._full(key), self.part_size)

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)  # now, not at the first next()
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
            for obj in page.get("Contents", ()):
                yield obj["Key"][len(base) :]

    def size(self, key: str) -> int:
        try:
            return int(self._client.head_object(Bucket=self.bucket, Key=self._full(key))["ContentLength"])
        except Exception as exc:
            if _is_not_found(exc):
                raise ObjectNotFound(f"no object {self.uri(key)}") from None
            raise

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self._full(key))


def _make_client(endpoint_url: str | None) -> Any:
    import boto3
    from botocore.config import Config

    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        retries={"max_attempts": 5, "mode": "standard"},
        # S3-compatible servers (MinIO, Ceph, moto) want path-style bucket addressing.
        s3={"addressing_style": "path"} if endpoint else {},
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


# ---- from a URL ---------------------------------------------------------------------------


def open_store(url: str, *, endpoint_url: str | None = None, part_size: int = 8 * MiB) -> ObjectStore:
    """The store a URL names: ``s3://bucket[/prefix]``, ``file:///dir`` or a plain path."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        return S3Store(parts.netloc, parts.path.strip("/"), endpoint_url=endpoint_url, part_size=part_size)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URLs must name a local path (file:///dir), got {redact_url(url)}")
        return LocalStore(unquote(parts.path))
    if parts.scheme == "" or len(parts.scheme) == 1:  # a plain path (or a Windows drive letter)
        return LocalStore(url)
    raise ValueError(
        f"unsupported storage URL scheme {parts.scheme!r} in {redact_url(url)}: use s3://bucket/prefix or a path"
    )


def open_store_from_settings(settings: Settings) -> ObjectStore:
    """The configured root store (``CONVEYOR_STORAGE_URL``, or the embedded directory)."""
    return open_store(
        settings.storage, endpoint_url=settings.storage_endpoint_url, part_size=settings.multipart_part_bytes
    )
