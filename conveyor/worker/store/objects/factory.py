"""The object store a URL (or the settings) names."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from conveyor.worker.core.limits import MiB
from conveyor.worker.core.settings import Settings, redact_url
from conveyor.worker.store.objects.base import ObjectStore
from conveyor.worker.store.objects.local import LocalStore
from conveyor.worker.store.objects.s3 import S3Store


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
