"""Object storage on S3 or any S3-compatible endpoint (boto3): streamed reads, multipart writes."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import Any, BinaryIO

from conveyor.worker.store.objects.base import (
    CHECK_KEY,
    S3_MIN_PART,
    InvalidKey,
    MiB,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectWriter,
    StorageUnavailable,
    validate_folder,
    validate_key,
    validate_prefix,
)

__all__ = ["ObjectChanged", "ObjectInfo", "S3Store"]
DELETE_BATCH = 1000  # S3's most keys in one DeleteObjects


class _RawBody(io.RawIOBase):
    """botocore's StreamingBody as a raw stream, so io.BufferedReader can wrap it. A stream
    cut mid-read is the endpoint becoming unreachable, said as ``StorageUnavailable``."""

    def __init__(self, body: Any, client: _Client) -> None:
        self._body, self._client = body, client

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            data = self._body.read(len(buffer))
        except Exception as exc:
            translated = self._client.translate(exc)
            if translated is None:
                raise
            raise translated from None
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


class ObjectChanged(RuntimeError):
    """The object was replaced between its listing and its read."""


def _error_code(exc: BaseException) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _is_not_found(exc: Exception) -> bool:
    return _error_code(exc) in ("404", "NoSuchKey", "NotFound")


_REFUSED_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_SERVER_TROUBLE = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "500", "502", "503", "504"}


class _Client:
    """The boto3 client with its errors said in Conveyor's terms: a missing bucket, missing
    or refused credentials, an unreachable endpoint or a failing server become
    ``StorageUnavailable`` naming the setting to fix. A missing object stays a ClientError
    (callers turn it into ``ObjectNotFound``), as does anything else."""

    def __init__(self, client: Any, bucket: str) -> None:
        self.raw, self.bucket = client, bucket

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.raw, name)
        if not callable(method) or name == "get_paginator":
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except Exception as exc:
                translated = self.translate(exc, head_bucket=name == "head_bucket")
                if translated is None:
                    raise
                raise translated from None

        return call

    def translate(self, exc: BaseException, *, head_bucket: bool = False) -> StorageUnavailable | None:
        from botocore import exceptions as be  # imported with boto3, which made this client

        where = f"s3://{self.bucket}"
        endpoint = self.raw.meta.endpoint_url
        if isinstance(exc, (be.NoCredentialsError, be.PartialCredentialsError)):
            return StorageUnavailable(
                f"no AWS credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE, or an instance role)",
                transient=False,
            )
        if isinstance(
            exc,
            (
                be.EndpointConnectionError,
                be.ConnectTimeoutError,
                be.ReadTimeoutError,
                be.ConnectionClosedError,
                be.ResponseStreamingError,
                be.IncompleteReadError,
            ),
        ):
            return StorageUnavailable(
                f"cannot reach the S3 endpoint {endpoint} for {where} ({type(exc).__name__}): check "
                "AWS_ENDPOINT_URL_S3 / CONVEYOR_STORAGE_ENDPOINT_URL and the network",
                transient=True,
            )
        code = _error_code(exc)
        if code == "NoSuchBucket" or (head_bucket and code in ("404", "NotFound")):
            return StorageUnavailable(
                f"the bucket {self.bucket!r} does not exist at {endpoint}: create it, or fix the bucket in "
                "CONVEYOR_STORAGE_URL (s3://bucket/prefix)",
                transient=False,
            )
        if code in _REFUSED_CREDENTIALS:
            return StorageUnavailable(
                f"{endpoint} refused the AWS credentials for {where} ({code}): check AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN (or AWS_PROFILE)",
                transient=False,
            )
        if code in ("AccessDenied", "403", "AllAccessDisabled"):
            return StorageUnavailable(
                f"access denied to {where} ({code}): the credentials in use lack permission on this bucket",
                transient=False,
            )
        if code in _SERVER_TROUBLE:
            return StorageUnavailable(f"the S3 endpoint {endpoint} is failing ({code}) for {where}", transient=True)
        return None


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
        self._client = client if isinstance(client, _Client) else _Client(client or _make_client(endpoint_url), bucket)

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str = "") -> str:
        path = self._full(key) if key else self.prefix
        return f"s3://{self.bucket}/{path}" if path else f"s3://{self.bucket}"

    def scoped(self, prefix: str) -> S3Store:
        return S3Store(self.bucket, self._full(prefix), client=self._client, part_size=self.part_size)

    def check(self) -> None:
        self._client.head_bucket(Bucket=self.bucket)
        self.put_bytes(CHECK_KEY, b"")
        self.delete(CHECK_KEY)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data)

    def open_read(self, key: str) -> BinaryIO:
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key))
        except Exception as exc:
            if _is_not_found(exc):
                raise ObjectNotFound(f"no object {self.uri(key)}") from None
            raise
        return io.BufferedReader(_RawBody(resp["Body"], self._client), buffer_size=1 * MiB)

    def open_write(self, key: str) -> ObjectWriter:
        return _S3Writer(self._client, self.bucket, self._full(key), self.part_size)

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)  # now, not at the first next()
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[str]:
        return (info.key for info in self._list_info(prefix))

    def list_info(self, prefix: str = "", *, start_after: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        return self._list_info(prefix, start_after)

    def _list_info(self, prefix: str, start_after: str = "") -> Iterator[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""
        args = {"StartAfter": base + start_after} if start_after else {}
        for page in self._pages(Prefix=base + prefix, **args):
            for obj in page.get("Contents", ()):
                modified = obj.get("LastModified")
                yield ObjectInfo(
                    obj["Key"][len(base) :],
                    int(obj["Size"]),
                    str(obj.get("ETag", "")),
                    modified.timestamp() if modified is not None else 0.0,
                )

    def list_folders(self, folder: str = "", *, start_after: str = "") -> Iterator[str]:
        validate_folder(folder)
        return self._list_folders(folder, start_after)

    def _list_folders(self, folder: str, start_after: str) -> Iterator[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        args: dict[str, Any] = {"Prefix": base + folder, "Delimiter": "/"}
        if start_after:
            # Past every key inside that folder: '0' is the character after '/'.
            args["StartAfter"] = base + start_after.rstrip("/") + "0"
        for page in self._pages(**args):
            for common in page.get("CommonPrefixes", ()):
                yield common["Prefix"][len(base) :]

    def _pages(self, **args: Any) -> Iterator[dict[str, Any]]:
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, **args)
        try:
            yield from pages
        except Exception as exc:
            translated = self._client.translate(exc)
            if translated is None:
                raise
            raise translated from None

    def delete_folder(self, folder: str) -> int:
        if not folder:
            raise InvalidKey("delete_folder needs a folder; it never empties the whole store")
        keys = list(self.list(validate_folder(folder)))
        for start in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": self._full(key)} for key in keys[start : start + DELETE_BATCH]]
            answer = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise StorageUnavailable(
                    f"S3 refused to delete {len(answer['Errors'])} objects under {self.uri(folder[:-1])}, "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}",
                    transient=first.get("Code") in ("InternalError", "SlowDown", "ServiceUnavailable"),
                )
        return len(keys)

    def open_version(self, key: str, etag: str) -> tuple[BinaryIO, dict[str, Any]]:
        """Read ``key`` only if its ETag is still ``etag`` (``ObjectChanged`` if it is not):
        the stream and the response's headers (encryption, ETag)."""
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key), IfMatch=etag)
        except Exception as exc:
            if _is_not_found(exc):
                raise ObjectNotFound(f"no object {self.uri(key)}") from None
            if _error_code(exc) in ("PreconditionFailed", "412"):
                raise ObjectChanged(f"{self.uri(key)} changed since it was listed") from None
            raise
        meta = {k: v for k, v in resp.items() if k != "Body"}
        return io.BufferedReader(_RawBody(resp["Body"], self._client), buffer_size=1 * MiB), meta

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
    # boto3 takes a noticeable time to import: only processes that open an S3 store pay it.
    import boto3
    from botocore.config import Config

    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(
        retries={"max_attempts": 5, "mode": "standard"},
        # S3-compatible servers (MinIO, Ceph, moto) want path-style bucket addressing.
        s3={"addressing_style": "path"} if endpoint else {},
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
