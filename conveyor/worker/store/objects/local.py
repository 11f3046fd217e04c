"""Object storage in a local directory: the embedded default, and tests.

Writes go to a temporary file beside the target and are renamed into place on commit, so a
reader never sees half an object and an aborted write leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from conveyor.worker.store.objects.base import (
    CHECK_KEY,
    TMP_MARK,
    InvalidKey,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectWriter,
    StorageUnavailable,
    validate_folder,
    validate_key,
    validate_prefix,
)


class _LocalWriter(ObjectWriter):
    def __init__(self, target: Path) -> None:
        super().__init__()
        target.parent.mkdir(parents=True, exist_ok=True)
        self._target = target
        self._tmp = target.with_name(f"{TMP_MARK}{uuid.uuid4().hex}-{target.name}")
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
        # Keys are checked lexically; the resolved path must be that same path, so no symlink
        # leads out of the store, nor inside it around a refusal by key (``jobs/...``).
        resolved = path.resolve()
        if not resolved.is_relative_to(self.root):
            raise InvalidKey(f"key {key!r} resolves outside the store at {self.root}")
        if resolved != path:
            raise InvalidKey(f"key {key!r} passes through a symbolic link in the store at {self.root}")
        return path

    def uri(self, key: str = "") -> str:
        return (self._path(key) if key else self._base()).as_uri()

    def check(self) -> None:
        try:
            self.put_bytes(CHECK_KEY, b"")
            self.delete(CHECK_KEY)
        except OSError as exc:
            raise StorageUnavailable(
                f"cannot write to the storage directory {self._base()}: {exc.strerror or exc} "
                "(set CONVEYOR_STORAGE_URL, or CONVEYOR_HOME for the embedded store)",
                transient=False,
            ) from None

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
        # Walk only the folder the prefix names (the part before its last '/').
        top = self._path(prefix[: prefix.rindex("/")]) if "/" in prefix else base
        if not top.is_dir():
            return iter(())
        keys = []
        for dirpath, _dirs, files in os.walk(top):
            rel_dir = Path(dirpath).relative_to(base).as_posix()
            for name in files:
                if name.startswith(TMP_MARK):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return iter(sorted(keys))

    def list_info(self, prefix: str = "", *, start_after: str = "") -> Iterator[ObjectInfo]:
        infos = []
        for key in (k for k in self.list(prefix) if k > start_after):
            with contextlib.suppress(FileNotFoundError):  # (deleted since it was listed)
                stat = self._path(key).stat()
                infos.append(ObjectInfo(key, stat.st_size, "", stat.st_mtime))
        return iter(infos)

    def list_folders(self, folder: str = "", *, start_after: str = "") -> Iterator[str]:
        validate_folder(folder)
        where = self._path(folder[:-1]) if folder else self._base()
        if not where.is_dir():
            return iter(())
        names = sorted(f"{folder}{e.name}/" for e in os.scandir(where) if e.is_dir(follow_symlinks=False))
        return (name for name in names if name > start_after and any(self.list(name)))

    def delete_folder(self, folder: str) -> int:
        gone = super().delete_folder(folder)
        where = self._path(folder[:-1])
        # The folders the objects were in, deepest first: a local store keeps no empty ones.
        for dirpath, _dirs, _files in sorted(os.walk(where), key=lambda d: len(d[0]), reverse=True):
            with contextlib.suppress(OSError):  # (not empty: a write under way)
                os.rmdir(dirpath)
        return gone

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(f"no object {path.as_uri()}")
        return path.stat().st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
