"""One object-store interface, exercised on a local directory and on S3 (moto server)."""

from __future__ import annotations

import os

import pytest

from conveyor.worker.store.objects.base import InvalidKey, ObjectNotFound, validate_key
from conveyor.worker.store.objects.factory import open_store
from conveyor.worker.store.objects.local import LocalStore
from conveyor.worker.store.objects.s3 import S3Store
from tests.worker.helpers import read_object

MiB = 1024 * 1024


def test_round_trip_list_exists_delete(store) -> None:
    job = store.scoped("jobs/batch_1")
    job.put_bytes("input.jsonl", b'{"prompt": "hi"}\n')
    job.put_bytes("parts/00001.jsonl", b"one\n")
    job.put_bytes("parts/00000.jsonl", b"zero\n")
    store.scoped("jobs/batch_2").put_bytes("input.jsonl", b"other")
    assert read_object(job, "input.jsonl") == b'{"prompt": "hi"}\n'
    assert job.size("parts/00001.jsonl") == 4
    assert list(job.list()) == ["input.jsonl", "parts/00000.jsonl", "parts/00001.jsonl"]
    assert list(job.list("parts/")) == ["parts/00000.jsonl", "parts/00001.jsonl"]
    assert list(store.list("jobs/batch_2/")) == ["jobs/batch_2/input.jsonl"]
    assert job.exists("input.jsonl") and not job.exists("missing")
    job.put_bytes("input.jsonl", b"replaced")
    assert read_object(job, "input.jsonl") == b"replaced"
    job.delete("input.jsonl")
    job.delete("input.jsonl")  # missing is fine
    assert not job.exists("input.jsonl")
    with pytest.raises(ObjectNotFound):
        job.open_read("input.jsonl")
    with pytest.raises(ObjectNotFound):
        job.size("input.jsonl")
    assert job.uri("parts/00000.jsonl").endswith("jobs/batch_1/parts/00000.jsonl")


def test_streamed_read_line_by_line(store) -> None:
    lines = [f"line {i}\n".encode() for i in range(50_000)]
    with store.open_write("big.txt") as w:
        for line in lines:
            w.write(line)
    with store.open_read("big.txt") as f:
        assert f.readline() == b"line 0\n"
        assert f.readline(3) == b"lin"
        rest = list(f)
    assert len(rest) == 49_999 and rest[-1] == b"line 49999\n"


def test_multipart_upload_is_memory_bounded(store) -> None:
    chunk = os.urandom(MiB // 2 + 3)  # odd size: parts never line up with writes
    with store.open_write("results.jsonl") as w:
        for _ in range(24):  # ~12 MiB -> 3 parts of 5 MiB on S3
            w.write(chunk)
        w.write(b"tail")
    expected = chunk * 24 + b"tail"
    assert w.bytes_written == len(expected)
    assert store.size("results.jsonl") == len(expected)
    with store.open_read("results.jsonl") as f:
        assert f.read() == expected
    if isinstance(store, S3Store):
        assert w._parts and len(w._parts) == 3
        assert w.max_buffered <= store.part_size


def test_a_failed_write_leaves_nothing(store) -> None:
    with pytest.raises(RuntimeError), store.open_write("out.jsonl") as w:
        w.write(os.urandom(6 * MiB))  # past one part on S3
        raise RuntimeError("worker died")
    assert not store.exists("out.jsonl")
    assert list(store.list()) == []
    if isinstance(store, S3Store):
        uploads = store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix).get("Uploads", [])
        assert uploads == []


@pytest.mark.parametrize(
    "key",
    ["", "/etc/passwd", "../x", "a/../../x", "a/./b", "a//b", "a/", "..", "a\\..\\b", "a\x00b", "é" * 600],
)
def test_keys_cannot_escape_their_prefix(store, key: str) -> None:
    job = store.scoped("jobs/batch_1")
    with pytest.raises(InvalidKey):
        job.put_bytes(key, b"x")
    with pytest.raises(InvalidKey):
        job.open_read(key)
    with pytest.raises(InvalidKey):
        job.exists(key)
    with pytest.raises(InvalidKey):
        job.delete(key)
    with pytest.raises(InvalidKey):
        store.scoped(key or "..")
    assert list(store.list()) == []


def test_list_rejects_escaping_prefixes(store) -> None:
    with pytest.raises(InvalidKey):
        store.list("../")
    with pytest.raises(InvalidKey):
        store.list("/abs")


def test_validate_key_accepts_ordinary_keys() -> None:
    for key in ["input.jsonl", "jobs/b_1/parts/00001.results.jsonl", "a b/ü.txt", ".hidden", "a..b"]:
        assert validate_key(key) == key


def test_local_store_refuses_a_symlink_out(tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(InvalidKey, match="outside"):
        LocalStore(root).open_read("link/secret")


def test_open_store_from_urls(tmp_path, s3_bucket: str) -> None:
    local = open_store((tmp_path / "objs").as_uri())
    assert isinstance(local, LocalStore) and local.root == (tmp_path / "objs").resolve()
    assert isinstance(open_store(str(tmp_path / "plain")), LocalStore)
    s3 = open_store(f"s3://{s3_bucket}/some/prefix")  # endpoint from AWS_ENDPOINT_URL
    assert isinstance(s3, S3Store) and s3.prefix == "some/prefix"
    s3.put_bytes("k", b"v")
    assert s3.uri("k") == f"s3://{s3_bucket}/some/prefix/k"
    assert read_object(open_store(f"s3://{s3_bucket}"), "some/prefix/k") == b"v"
    with pytest.raises(InvalidKey):
        open_store(f"s3://{s3_bucket}/a/../b")
    with pytest.raises(ValueError, match="unsupported storage URL scheme 'ftp'") as info:
        open_store("ftp://user:pw@host/x")
    assert "pw" not in str(info.value)
    with pytest.raises(ValueError, match="at least"):
        S3Store(s3_bucket, part_size=1024, client=object())


def test_local_store_refuses_a_symlink_inside_it_too(tmp_path) -> None:
    """A link from an input's key to a job's objects would get around the refusal of
    ``jobs/...`` keys, which is made on the key: every key must resolve to itself."""
    store = LocalStore(tmp_path / "root")
    store.put_bytes("jobs/batch_1/results.jsonl", b"another tenant's results")
    (tmp_path / "root" / "inputs").mkdir()
    (tmp_path / "root" / "inputs" / "link.jsonl").symlink_to(tmp_path / "root" / "jobs" / "batch_1" / "results.jsonl")
    (tmp_path / "root" / "dir").symlink_to(tmp_path / "root" / "jobs")
    for key in ("inputs/link.jsonl", "dir/batch_1/results.jsonl"):
        with pytest.raises(InvalidKey, match="passes through a symbolic link"):
            store.open_read(key)
        with pytest.raises(InvalidKey):
            store.key_of((tmp_path / "root").as_uri() + "/" + key)
    assert store.open_read("jobs/batch_1/results.jsonl").read() == b"another tenant's results"
