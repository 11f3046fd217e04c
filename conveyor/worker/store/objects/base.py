"""The object-storage interface (backends: ``local``, ``s3``; from a URL: ``factory``).

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

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO
from urllib.parse import unquote

from conveyor.worker.core.limits import MiB

S3_MIN_PART = 5 * MiB
MAX_KEY_BYTES = 1024  # S3's limit on a full key
TMP_MARK = ".conveyor-tmp-"
CHECK_KEY = ".conveyor-check"  # the probe object ``check`` writes and deletes


class InvalidKey(ValueError):
    """A key that is empty, absolute, or could escape its prefix."""


class ObjectNotFound(KeyError):
    """No object under that key."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "object not found"


class StorageUnavailable(RuntimeError):
    """The object store cannot be used: misconfigured (a missing bucket, no or refused
    credentials, an unwritable directory) or unreachable. The message names the problem and
    the setting to fix; ``transient`` says whether waiting may help (an unreachable endpoint,
    a 5xx) or a person must change something first."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


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


def validate_folder(prefix: str) -> str:
    """A folder: ``""`` (the store itself) or a key followed by ``/``."""
    if prefix and not prefix.endswith("/"):
        raise InvalidKey(f"folder {prefix!r} must end with '/'")
    return validate_prefix(prefix)


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key (relative to the store's prefix), size, ETag (quoted, as S3
    gives it; empty for a local file) and when it was last written (Unix seconds)."""

    key: str
    size: int
    etag: str
    modified: float = 0.0


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
    def list_info(self, prefix: str = "", *, start_after: str = "") -> Iterator[ObjectInfo]:
        """Like ``list``, with each object's size, ETag and time of writing; only the keys
        after ``start_after``, to page through many."""

    @abstractmethod
    def list_folders(self, folder: str = "", *, start_after: str = "") -> Iterator[str]:
        """The folders directly under ``folder`` (``""`` or ending with ``/``) that hold an
        object, each as a prefix ending with ``/``, in order; only those after the folder
        ``start_after``, to page through many."""

    def delete_folder(self, folder: str) -> int:
        """Remove every object under ``folder`` (a non-empty prefix ending with ``/``, so it
        can never take a sibling that only starts the same way); how many there were."""
        if not folder:
            raise InvalidKey("delete_folder needs a folder; it never empties the whole store")
        keys = list(self.list(validate_folder(folder)))
        for key in keys:
            self.delete(key)
        return len(keys)

    @abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes (``ObjectNotFound`` if missing)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing key is not an error."""

    @abstractmethod
    def check(self) -> None:
        """Raise ``StorageUnavailable`` unless objects can be written, read and deleted
        here: run before a job's input is uploaded and when a worker starts."""

    def key_of(self, uri: str) -> str:
        """The key, relative to this store, of the object ``uri`` names (as ``uri(key)``
        writes it); ``InvalidKey`` unless it names an object under this store's prefix, so a
        URI from a user can never reach outside the store."""
        root = self.uri().rstrip("/") + "/"
        if not isinstance(uri, str) or not uri.startswith(root):
            raise InvalidKey(f"{uri!r:.300} is not an object in this store (its URIs start with {root})")
        rest = uri[len(root) :]
        for key in dict.fromkeys((rest, unquote(rest))):  # file:// URIs percent-encode
            with contextlib.suppress(InvalidKey):
                if self.uri(validate_key(key)) == uri:
                    return key
        raise InvalidKey(f"{uri!r:.300} does not name an object key in this store")

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True
