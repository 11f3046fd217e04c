"""Weights from an object store (``--model s3://bucket/prefix/``), over moto's S3 server (real
HTTP): fetched once into the model cache, verified, reused; token-identical to the same
checkpoint loaded from its directory; refused with a clear reason when the prefix is wrong,
too large, or holds keys that would escape it."""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.jobs.model_names import InvalidModel, canonical_model
from conveyor.worker.store.model_cache import MANIFEST, ModelCache, ModelFetchError, ModelUri
from conveyor.worker.store.objects.s3 import S3Store
from tests.worker.helpers import jsonl, openai_lines, parse_lines, wait_for
from tests.worker.services import free_port


def _upload(s3_client: Any, bucket: str, model_dir: str, prefix: str) -> list[str]:
    names = sorted(p.name for p in Path(model_dir).iterdir() if p.is_file())
    for name in names:
        s3_client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=(Path(model_dir) / name).read_bytes())
    return names


@pytest.fixture
def s3_model(s3_client, s3_bucket, tiny_model) -> tuple[str, list[str]]:
    """The tiny model's files under s3://<bucket>/tiny/ (the URI, the file names)."""
    return f"s3://{s3_bucket}/tiny/", _upload(s3_client, s3_bucket, tiny_model, "tiny")


@pytest.fixture
def gets(monkeypatch) -> list[str]:
    """The keys each object GET of a model fetch read, in this process."""
    seen: list[str] = []
    original = S3Store.open_version

    def counted(self: S3Store, key: str, etag: str) -> Any:
        seen.append(key)
        return original(self, key, etag)

    monkeypatch.setattr(S3Store, "open_version", counted)
    return seen


def _cache(root: Path, client: Any = None, **kwargs: Any) -> ModelCache:
    def store_for(m: ModelUri) -> S3Store:
        return S3Store(m.bucket, m.prefix.rstrip("/"), client=client)

    return ModelCache(root, store_for=store_for, **kwargs)


def _bodies(path: Path) -> list[dict[str, Any]]:
    rows = parse_lines(path.read_text().splitlines())
    return [
        {"id": r["custom_id"], "text": r["response"]["body"]["choices"][0]["message"]["content"],
         "usage": r["response"]["body"]["usage"]}
        for r in rows
    ]  # fmt: skip


def test_s3_uris_are_canonical_and_checked() -> None:
    assert canonical_model("s3://bucket/org/tiny") == "s3://bucket/org/tiny/"
    assert canonical_model("s3://bucket/org/tiny//") == "s3://bucket/org/tiny/"
    assert canonical_model("s3://bucket") == "s3://bucket/"
    for bad in ("s3://", "s3:///tiny/", "s3://bucket/../x/", "s3://bucket/a//b/", "s3://bucket/a?x=1", "s3://b/a\\b"):
        with pytest.raises(InvalidModel):
            canonical_model(bad)


def test_run_from_s3_is_token_identical_and_a_second_start_downloads_nothing(
    embedded_stack, env, s3_model, gets, tmp_path, caplog
) -> None:
    uri, names = s3_model
    stack = env(embedded_stack, model_cache=str(tmp_path / "cache"))
    inputs = tmp_path / "in.jsonl"
    inputs.write_bytes(jsonl(openai_lines(4, max_tokens=12)))
    local, first, second = tmp_path / "local.jsonl", tmp_path / "s3-1.jsonl", tmp_path / "s3-2.jsonl"
    assert main(["run", str(inputs), "--model", stack.model, "-o", str(local), "-q"]) == 0
    assert main(["run", str(inputs), "--model", uri.rstrip("/"), "-o", str(first), "-q"]) == 0
    assert sorted(gets) == names  # each file fetched once
    copy = ModelCache(tmp_path / "cache", store_for=lambda m: pytest.fail("no store")).path_for(uri)
    assert sorted(p.name for p in copy.iterdir()) == sorted([*names, MANIFEST])
    inodes = {p.name: p.stat().st_ino for p in copy.iterdir()}
    assert _bodies(first) == _bodies(local)  # the same tokens as from the local directory

    gets.clear()
    with caplog.at_level(logging.INFO, logger="conveyor.worker"):
        assert main(["run", str(inputs), "--model", uri, "-o", str(second), "-q"]) == 0
    assert gets == []  # listed, found unchanged and intact: nothing downloaded
    assert f"model {uri}: cache ({len(names)} files" in caplog.text
    assert {p.name: p.stat().st_ino for p in copy.iterdir()} == inodes
    assert _bodies(second) == _bodies(local)


def test_a_corrupted_cached_file_is_detected_and_fetched_again(s3_client, s3_model, gets, tmp_path) -> None:
    uri, names = s3_model
    cache = _cache(tmp_path / "cache", s3_client)
    first = cache.fetch(uri)
    assert first.source == "download" and first.downloaded_files == len(names) == first.files
    weights = first.path / "model.safetensors"
    good = weights.read_bytes()
    with open(weights, "r+b") as f:  # flip bytes in place: same size
        f.seek(len(good) // 2)
        f.write(bytes(b ^ 0xFF for b in good[len(good) // 2 : len(good) // 2 + 16]))
    kept = (first.path / "config.json").stat().st_ino
    gets.clear()
    again = cache.fetch(uri)
    assert gets == ["model.safetensors"] and again.downloaded_files == 1
    assert weights.read_bytes() == good
    assert (again.path / "config.json").stat().st_ino == kept  # the intact files are kept, not fetched
    assert cache.fetch(uri).source == "cache"

    # The quick check (sizes and modification times) sees a truncated or rewritten file too.
    quick = _cache(tmp_path / "cache", s3_client, verify="size")
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    gets.clear()
    assert quick.fetch(uri).downloaded_files == 1 and gets == ["model.safetensors"]
    assert weights.read_bytes() == good


def test_an_object_added_or_removed_in_the_store_is_followed(s3_client, s3_bucket, s3_model, gets, tmp_path) -> None:
    uri, _ = s3_model
    cache = _cache(tmp_path / "cache", s3_client)
    cache.fetch(uri)
    s3_client.put_object(Bucket=s3_bucket, Key="tiny/notes.txt", Body=b"new")
    gets.clear()
    result = cache.fetch(uri)
    assert gets == ["notes.txt"] and (result.path / "notes.txt").read_bytes() == b"new"
    s3_client.delete_object(Bucket=s3_bucket, Key="tiny/notes.txt")  # gone from the store: gone from the copy
    gets.clear()
    result = cache.fetch(uri)
    assert gets == [] and not (result.path / "notes.txt").exists() and result.source == "download"
    assert cache.fetch(uri).source == "cache"


def test_two_starts_on_one_node_download_once(s3_client, s3_model, gets, tmp_path) -> None:
    uri, names = s3_model
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda: results.append(_cache(tmp_path / "cache", s3_client).fetch(uri)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(gets) == names  # one download of each file, whoever took the lock first
    assert sorted(r.source for r in results) == ["cache", "cache", "download"]
    assert len({r.path for r in results}) == 1


def test_limits_refuse_a_prefix_too_large_before_fetching_anything(s3_client, s3_model, gets, tmp_path) -> None:
    uri, _ = s3_model
    with pytest.raises(ModelFetchError, match="more than CONVEYOR_MODEL_MAX_BYTES=1000: is the prefix right"):
        _cache(tmp_path / "cache", s3_client, max_bytes=1000).fetch(uri)
    with pytest.raises(ModelFetchError, match=r"more than 2 files \(CONVEYOR_MODEL_MAX_FILES\)"):
        _cache(tmp_path / "cache", s3_client, max_files=2).fetch(uri)
    assert gets == [] and not list((tmp_path / "cache" / "models").iterdir())


def test_a_missing_prefix_or_an_escaping_key_is_refused_naming_it(s3_client, s3_bucket, tmp_path) -> None:
    cache = _cache(tmp_path / "cache", s3_client)
    with pytest.raises(ModelFetchError, match=rf"model s3://{s3_bucket}/nothing/here/: there is no object"):
        cache.fetch(f"s3://{s3_bucket}/nothing/here")
    s3_client.put_object(Bucket=s3_bucket, Key="evil/config.json", Body=b"{}")
    s3_client.put_object(Bucket=s3_bucket, Key="evil/a/../../outside", Body=b"x")
    with pytest.raises(ModelFetchError, match=r"refusing the object key 'a/\.\./\.\./outside'"):
        cache.fetch(f"s3://{s3_bucket}/evil/")
    assert not (tmp_path / "cache" / "outside").exists()


def test_an_unreachable_store_starts_from_a_verified_copy_with_a_warning(s3_client, s3_model, tmp_path, caplog) -> None:
    import boto3
    from botocore.config import Config

    uri, names = s3_model
    _cache(tmp_path / "cache", s3_client).fetch(uri)
    dead = boto3.session.Session().client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, s3={"addressing_style": "path"}),
    )
    with caplog.at_level(logging.WARNING):
        result = _cache(tmp_path / "cache", dead).fetch(uri)
    assert result.source == "cache, store unreachable" and result.files == len(names)
    assert "cannot reach the store for" in caplog.text
    with pytest.raises(ModelFetchError, match=rf"cannot list the model {uri} and no verified copy is cached"):
        _cache(tmp_path / "other-cache", dead).fetch(uri)


def test_a_worker_serves_a_model_from_s3(embedded_stack, s3_model, spawn_worker, tmp_path, env, capsys) -> None:
    uri, _ = s3_model
    # (s3_model's bucket fixture put the fake credentials and moto's endpoint in the environment.)
    stack = embedded_stack.with_values(model=uri, model_cache=str(tmp_path / "cache"))
    worker = spawn_worker(stack)
    worker.wait_ready(120)
    assert re.search(r"cold start [\d.]+ s: import [\d.]+ s, weights [\d.]+ s \(download [\d.]+ s", worker.log())
    copy = ModelCache(tmp_path / "cache", store_for=lambda m: pytest.fail("no store")).path_for(uri)
    assert (copy / MANIFEST).is_file() and (copy / "model.safetensors").is_file()
    env(stack)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(3)))
    assert main(["submit", str(path), "--model", uri.rstrip("/"), "--json"]) == 0  # not refused as a local path
    job = json.loads(capsys.readouterr().out)
    assert job["model"] == uri
    client = Client(stack.settings)
    try:
        done = wait_for(lambda: (j := client.status(job["id"]))["status"] == "completed" and j, 90, "the job")
        assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    finally:
        client.close()
