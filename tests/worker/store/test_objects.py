"""One object-store interface, exercised on a local directory and on S3 (moto server)."""

from __future__ import annotations

import os
import time

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


def test_folders_listed_in_pages_and_deleted_whole(store) -> None:
    for job in ("batch_1", "batch_10", "batch_2", "batch_3"):
        store.put_bytes(f"jobs/{job}/input.jsonl", b"x")
    store.put_bytes("jobs/batch_1/shards/000000.jsonl", b"s0")
    store.put_bytes("jobs/batch_1/shards/000001.jsonl", b"s1")
    store.put_bytes("jobs/batch_1/results.jsonl", b"r")
    store.put_bytes("jobs/loose.txt", b"not in a folder")
    store.put_bytes("files/f/content", b"c")
    assert list(store.list_folders()) == ["files/", "jobs/"]
    every = ["jobs/batch_1/", "jobs/batch_10/", "jobs/batch_2/", "jobs/batch_3/"]
    assert list(store.list_folders("jobs/")) == every
    assert list(store.list_folders("jobs/", start_after="jobs/batch_1/")) == every[1:]
    assert list(store.list_folders("jobs/", start_after="jobs/batch_2/")) == every[3:]
    assert list(store.list_folders("jobs/batch_1/")) == ["jobs/batch_1/shards/"]
    infos = {info.key: info for info in store.list_info("jobs/batch_1/")}
    assert sorted(infos) == ["jobs/batch_1/input.jsonl", "jobs/batch_1/results.jsonl", *(
        f"jobs/batch_1/shards/00000{i}.jsonl" for i in range(2))]  # fmt: skip
    assert infos["jobs/batch_1/shards/000001.jsonl"].size == 2
    assert abs(infos["jobs/batch_1/results.jsonl"].modified - time.time()) < 120
    after = [info.key for info in store.list_info("jobs/", start_after="jobs/batch_1/shards/000000.jsonl")]
    assert after == [
        "jobs/batch_1/shards/000001.jsonl",
        *(f"jobs/batch_{j}/input.jsonl" for j in (10, 2, 3)),
        "jobs/loose.txt",
    ]

    job = store.scoped("jobs/batch_1")
    assert job.delete_folder("shards/") == 2
    assert job.delete_folder("shards/") == 0  # again: nothing left, no error
    assert list(job.list()) == ["input.jsonl", "results.jsonl"]
    assert store.delete_folder("jobs/batch_1/") == 2  # its sibling batch_10 stays
    assert list(store.list_folders("jobs/")) == every[1:]
    assert store.exists("jobs/batch_10/input.jsonl") and store.exists("jobs/loose.txt")
    for bad in ("", "jobs", "../", "jobs/../"):
        with pytest.raises(InvalidKey):
            store.delete_folder(bad)
    with pytest.raises(InvalidKey):
        list(store.list_folders("jobs"))


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
