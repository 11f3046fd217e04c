"""Weights from an object store: ``s3://bucket/prefix/`` downloaded once into the model cache.

``fetch_model(settings, "s3://bucket/prefix/")`` returns a local directory holding every
object under the prefix (keys below it become relative paths), for the engine to load.

- **Once per node.** Each URI has its directory under ``CONVEYOR_MODEL_CACHE``
  (``models/<slug>-<hash>``). A fetch holds an exclusive file lock on that URI (``locks/``),
  so a second worker starting beside the first waits, then finds the copy made. A download
  goes into a temporary directory (``tmp/``) and is renamed into place complete: a crash
  leaves no half copy where a later start would look.
- **Limits.** The listing is checked before a byte is fetched: at most
  ``CONVEYOR_MODEL_MAX_FILES`` objects and ``CONVEYOR_MODEL_MAX_BYTES`` bytes, and no more
  than the cache's disk has free. Every key must be a safe relative path below the prefix
  (no ``..``, no absolute paths), so nothing is written outside the copy's directory.
- **Parallel.** Objects download on ``CONVEYOR_MODEL_DOWNLOAD_THREADS`` threads, each read
  pinned to the ETag the listing gave (an object replaced meanwhile fails the fetch rather
  than mixing two versions).
- **Verified.** Each downloaded file must have the listed size; where the ETag is the
  object's MD5 (a single-part upload without SSE-KMS or SSE-C encryption), the MD5 must
  match it too. Its SHA-256 is computed while it downloads and written with its key, size
  and ETag to the copy's manifest (``.conveyor-manifest.json``, inside the directory).
- **Reused.** A later start lists the prefix again: files whose key, size and ETag match the
  manifest and whose local bytes still verify are kept (``CONVEYOR_MODEL_CACHE_VERIFY``:
  ``sha256`` re-hashes them, ``size`` checks sizes and modification times only); nothing is
  downloaded when all are. A file that fails (corrupted on disk, changed in the store) is
  fetched again, the others hard-linked into the new copy. If the store cannot be reached
  but a complete copy verifies, the worker starts from it with a warning.

What this guarantees: the copy the engine loads is exactly the bytes the store held under
that listing's ETags (SHA-256 recorded on arrival and re-checked at every start in the
default mode), transfer errors are caught by the size (and the MD5 where the ETag is one).
It does not prove the store's objects are the ones you meant: pin a prefix per model
version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.worker.core.file_lock import file_lock
from conveyor.worker.core.settings import Settings
from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, StorageUnavailable, validate_key
from conveyor.worker.store.objects.s3 import ObjectChanged, ObjectInfo, S3Store

log = logging.getLogger(__name__)

SCHEME = "s3://"
MANIFEST = ".conveyor-manifest.json"
MANIFEST_VERSION = 1
CHUNK = 1 << 20
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_MD5_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})"?$')
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class ModelFetchError(ValueError):
    """The weights cannot be fetched: the message names the URI or the setting to change."""


def is_model_uri(model: str) -> bool:
    """Whether ``model`` names weights in an object store (``s3://...``)."""
    return isinstance(model, str) and model.startswith(SCHEME)


@dataclass(frozen=True)
class ModelUri:
    bucket: str
    prefix: str  # "" (the whole bucket) or "a/b/": always ending with "/"

    @classmethod
    def parse(cls, uri: str) -> ModelUri:
        """``s3://bucket/prefix/`` (the trailing slash optional); ``ValueError`` saying why not."""
        if not is_model_uri(uri):
            raise ValueError(f"{uri!r} is not an s3://bucket/prefix/ URI")
        rest = uri[len(SCHEME) :]
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.match(bucket):
            raise ValueError(f"{uri!r} has no valid bucket name (s3://bucket/prefix/)")
        if "?" in prefix or "#" in prefix:
            raise ValueError(f"{uri!r} has a query or fragment; name a prefix: s3://bucket/prefix/")
        prefix = prefix.rstrip("/")
        if prefix:
            try:
                validate_key(prefix)
            except InvalidKey as exc:
                raise ValueError(f"{uri!r}: the prefix is not a safe key: {exc}") from None
        return cls(bucket, f"{prefix}/" if prefix else "")

    @property
    def uri(self) -> str:
        """The canonical form: ``s3://bucket/prefix/``."""
        return f"{SCHEME}{self.bucket}/{self.prefix}"

    @property
    def dir_name(self) -> str:
        """A directory name for this URI's copy: readable, and unique by a hash."""
        slug = _UNSAFE.sub("_", f"{self.bucket}_{self.prefix}").strip("_.")[:64] or "model"
        return f"{slug}-{hashlib.blake2b(self.uri.encode(), digest_size=8).hexdigest()}"


def canonical_model_uri(uri: str) -> str:
    return ModelUri.parse(uri).uri


@dataclass
class FetchResult:
    path: Path  # the local directory the engine loads
    source: str  # "download" (some files fetched), "cache" (none), "cache, store unreachable"
    files: int  # files in the copy
    bytes: int
    downloaded_files: int = 0
    downloaded_bytes: int = 0
    seconds: float = 0.0


@dataclass
class _File:
    rel: str  # path inside the copy (the key below the prefix)
    info: ObjectInfo  # key relative to the model's store (= rel), size, ETag


@dataclass
class _Manifest:
    uri: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # rel -> size, etag, sha256, mtime_ns

    @classmethod
    def read(cls, directory: Path) -> _Manifest | None:
        try:
            data = json.loads((directory / MANIFEST).read_text())
            if data.get("version") != MANIFEST_VERSION:
                return None
            return cls(str(data["uri"]), dict(data["files"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def write(self, directory: Path) -> None:
        data = {"version": MANIFEST_VERSION, "uri": self.uri, "created_at": time.time(), "files": self.files}
        (directory / MANIFEST).write_text(json.dumps(data, indent=1, sort_keys=True))


def fetch_model(settings: Settings, uri: str) -> FetchResult:
    """The local copy of the weights at ``uri``, downloaded (or refreshed) when needed."""
    return ModelCache.from_settings(settings).fetch(uri)


class ModelCache:
    def __init__(
        self,
        root: Path,
        *,
        store_for: Callable[[ModelUri], S3Store],
        max_files: int = 1000,
        max_bytes: int = 1 << 40,
        threads: int = 8,
        verify: str = "sha256",
    ) -> None:
        if verify not in ("sha256", "size"):
            raise ValueError(f"verify must be 'sha256' or 'size', got {verify!r}")
        self.root = Path(root)
        self.store_for = store_for
        self.max_files, self.max_bytes, self.threads, self.verify = max_files, max_bytes, threads, verify

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelCache:
        def store_for(m: ModelUri) -> S3Store:
            # The project's S3 client: CONVEYOR_STORAGE_ENDPOINT_URL, else AWS_ENDPOINT_URL(_S3),
            # and boto3's usual credentials.
            return S3Store(m.bucket, m.prefix.rstrip("/"), endpoint_url=settings.storage_endpoint_url)

        return cls(
            settings.model_cache_dir,
            store_for=store_for,
            max_files=settings.model_max_files,
            max_bytes=settings.model_max_bytes,
            threads=settings.model_download_threads,
            verify=settings.model_cache_verify,
        )

    def path_for(self, uri: str) -> Path:
        return self.root / "models" / ModelUri.parse(uri).dir_name

    # ---- fetch -------------------------------------------------------------------------

    def fetch(self, uri: str) -> FetchResult:
        started = time.perf_counter()
        try:
            m = ModelUri.parse(uri)
        except ValueError as exc:
            raise ModelFetchError(str(exc)) from None
        final = self.root / "models" / m.dir_name
        for sub in ("models", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        with file_lock(self.root / "locks" / f"{m.dir_name}.lock"):
            stale = [*(self.root / "tmp").glob(f"{m.dir_name}.*"), *final.parent.glob(f"{m.dir_name}.old-*")]
            for path in stale:  # a crashed fetch's leftovers
                shutil.rmtree(path, ignore_errors=True)
            old = _Manifest.read(final)
            store = self.store_for(m)
            try:
                listing = self._listing(m, store)
            except StorageUnavailable as exc:
                if old is not None and old.uri == m.uri and not self._bad_files(final, old, set(old.files)):
                    log.warning(
                        "cannot reach the store for %s (%s); starting from the verified copy in %s", m.uri, exc, final
                    )
                    total = sum(int(f["size"]) for f in old.files.values())
                    return FetchResult(final, "cache, store unreachable", len(old.files), total)
                raise ModelFetchError(f"cannot list the model {m.uri} and no verified copy is cached: {exc}") from None
            keep = self._reusable(final, old, listing) if old is not None and old.uri == m.uri else set()
            todo = [f for f in listing if f.rel not in keep]
            total = sum(f.info.size for f in listing)
            if not todo and old is not None and set(old.files) == {f.rel for f in listing}:
                return FetchResult(final, "cache", len(listing), total, seconds=time.perf_counter() - started)
            if keep:
                log.warning("model %s: %d file(s) new, changed in the store or failing verification: fetching them",
                            m.uri, len(todo))  # fmt: skip
            self._check_space(sum(f.info.size for f in todo))
            tmp = self.root / "tmp" / f"{m.dir_name}.{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                manifest = _Manifest(m.uri)
                for f in listing:
                    if f.rel in keep:
                        assert old is not None
                        _link_or_copy(final / f.rel, tmp / f.rel)
                        manifest.files[f.rel] = dict(old.files[f.rel])
                log.info("downloading %d file(s), %.1f MiB, of %s into %s", len(todo),
                         sum(f.info.size for f in todo) / 2**20, m.uri, final)  # fmt: skip
                threads = max(1, min(self.threads, len(todo)))  # (none to fetch: a file was deleted upstream)
                with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="conveyor-fetch") as pool:
                    for rel, entry in pool.map(lambda f: self._download(store, m, f, tmp), todo):
                        manifest.files[rel] = entry
                manifest.write(tmp)
                _replace_dir(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        seconds = time.perf_counter() - started
        fetched = sum(f.info.size for f in todo)
        log.info("model %s: %d file(s), %.1f MiB, fetched in %.1f s", m.uri, len(todo), fetched / 2**20, seconds)
        return FetchResult(final, "download", len(listing), total, len(todo), fetched, seconds)

    def _listing(self, m: ModelUri, store: S3Store) -> list[_File]:
        files: list[_File] = []
        total = 0
        for info in store.list_info():
            if info.key.endswith("/") or not info.key:  # a "directory" marker
                continue
            try:
                validate_key(info.key)
            except InvalidKey as exc:
                raise ModelFetchError(f"model {m.uri}: refusing the object key {info.key!r}: {exc}") from None
            if info.key == MANIFEST:
                raise ModelFetchError(f"model {m.uri}: an object is named {MANIFEST}, which the cache keeps for itself")
            files.append(_File(info.key, info))
            total += info.size
            if len(files) > self.max_files:
                raise ModelFetchError(
                    f"model {m.uri} holds more than {self.max_files} files (CONVEYOR_MODEL_MAX_FILES): is the prefix "
                    "right? raise CONVEYOR_MODEL_MAX_FILES if it is"
                )
        if not files:
            raise ModelFetchError(f"model {m.uri}: there is no object under this prefix (check the --model URI)")
        if total > self.max_bytes:
            raise ModelFetchError(
                f"model {m.uri} holds {total} bytes ({total / 2**30:.2f} GiB), more than CONVEYOR_MODEL_MAX_BYTES="
                f"{self.max_bytes}: is the prefix right? raise CONVEYOR_MODEL_MAX_BYTES if it is"
            )
        # Two keys that differ only by a file and a directory of the same name cannot both be files.
        rels = {f.rel for f in files}
        for rel in rels:
            parent = rel.rpartition("/")[0]
            while parent:
                if parent in rels:
                    raise ModelFetchError(f"model {m.uri}: {parent!r} is both an object and a prefix of {rel!r}")
                parent = parent.rpartition("/")[0]
        return files

    def _check_space(self, needed: int) -> None:
        free = shutil.disk_usage(self.root).free
        if needed > free:
            raise ModelFetchError(
                f"the model cache {self.root} (CONVEYOR_MODEL_CACHE) has {free / 2**30:.2f} GiB free, "
                f"{needed / 2**30:.2f} GiB are needed"
            )

    def _reusable(self, final: Path, old: _Manifest, listing: list[_File]) -> set[str]:
        """The listed files the cached copy holds unchanged (same size and ETag) and intact."""
        same = {
            f.rel
            for f in listing
            if (e := old.files.get(f.rel)) is not None and int(e["size"]) == f.info.size and e["etag"] == f.info.etag
        }
        return same - self._bad_files(final, old, same)

    def _bad_files(self, final: Path, manifest: _Manifest, rels: set[str]) -> set[str]:
        """Those of ``rels`` whose local bytes no longer match the manifest."""
        bad = set()
        for rel in sorted(rels):
            entry = manifest.files[rel]
            path = final / rel
            try:
                st = path.stat()
                ok = st.st_size == int(entry["size"])
                if ok and self.verify == "sha256":
                    ok = _sha256(path) == entry["sha256"]
                elif ok:
                    ok = st.st_mtime_ns == int(entry["mtime_ns"])
            except (OSError, KeyError, ValueError):
                ok = False
            if not ok:
                log.warning("cached file %s does not match the manifest (%s check)", path, self.verify)
                bad.add(rel)
        return bad

    def _download(self, store: S3Store, m: ModelUri, f: _File, tmp: Path) -> tuple[str, dict[str, Any]]:
        target = tmp / f.rel
        target.parent.mkdir(parents=True, exist_ok=True)
        sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
        size = 0
        try:
            stream, meta = store.open_version(f.info.key, f.info.etag)
        except (ObjectNotFound, ObjectChanged) as exc:
            raise ModelFetchError(f"model {m.uri}: {exc} (was it being replaced? start again)") from None
        with stream, open(target, "wb") as out:
            while chunk := stream.read(CHUNK):
                out.write(chunk)
                sha.update(chunk)
                md5.update(chunk)
                size += len(chunk)
        where = f"{m.uri}{f.rel}"
        if size != f.info.size:
            raise ModelFetchError(f"downloading {where}: got {size} bytes, the listing said {f.info.size}")
        plain_md5 = _MD5_ETAG.match(f.info.etag)
        encrypted = meta.get("ServerSideEncryption") in ("aws:kms", "aws:kms:dsse") or meta.get("SSECustomerAlgorithm")
        if plain_md5 and not encrypted and md5.hexdigest() != plain_md5.group(1).lower():
            raise ModelFetchError(f"downloading {where}: the bytes' MD5 does not match the object's ETag (corrupted)")
        entry = {
            "key": m.prefix + f.rel,
            "size": size,
            "etag": f.info.etag,
            "sha256": sha.hexdigest(),
            "mtime_ns": target.stat().st_mtime_ns,
        }
        return f.rel, entry


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _replace_dir(new: Path, final: Path) -> None:
    """Put ``new`` where ``final`` is (each rename is atomic; the old copy is removed after)."""
    if final.exists():
        trash = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
        os.rename(new, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(new, final)
