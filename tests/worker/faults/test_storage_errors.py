"""Storage mistakes are named with the setting to fix, on submit (before anything is stored)
and at worker start (which refuses to consume), against moto's S3 server over real HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select

from conveyor.worker.core.settings import Settings
from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.models import Job
from conveyor.worker.store.objects.base import StorageUnavailable
from conveyor.worker.store.objects.factory import open_store
from conveyor.worker.store.objects.local import LocalStore
from tests.worker.helpers import REPO, jsonl, openai_lines

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens there


def _no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def broken_store(request, monkeypatch, tmp_path, aws_env, s3_bucket):
    """(storage URL, words the error must contain) for one kind of storage mistake."""
    kind = request.param
    if kind == "missing bucket":
        return "s3://no-such-bucket-here/conveyor", ["'no-such-bucket-here' does not exist", "CONVEYOR_STORAGE_URL"]
    if kind == "no credentials":
        _no_credentials(monkeypatch, tmp_path)
        return f"s3://{s3_bucket}/conveyor", ["no AWS credentials", "AWS_ACCESS_KEY_ID"]
    assert kind == "unreachable endpoint"
    monkeypatch.setenv("AWS_ENDPOINT_URL", UNREACHABLE)
    return f"s3://{s3_bucket}/conveyor", [f"cannot reach the S3 endpoint {UNREACHABLE}", "AWS_ENDPOINT_URL_S3"]


@pytest.mark.parametrize("broken_store", ["missing bucket", "no credentials", "unreachable endpoint"], indirect=True)
def test_submit_names_the_storage_problem_and_stores_nothing(broken_store, monkeypatch, tmp_path, capsys) -> None:
    url, words = broken_store
    home = tmp_path / "home"
    monkeypatch.setenv("CONVEYOR_HOME", str(home))
    monkeypatch.setenv("CONVEYOR_STORAGE_URL", url)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(3)))
    assert main(["submit", str(path), "--model", "Qwen/Qwen3-0.6B"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("conveyor: error: ") and "internal error" not in err and "\n" not in err, err
    for word in words:
        assert word in err, err
    with Client(Settings(home=home)) as client, client.db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Job)).scalar_one() == 0  # no job half-made


def test_a_working_store_passes_the_check_and_leaves_nothing(s3_bucket, tmp_path) -> None:
    store = open_store(f"s3://{s3_bucket}/conveyor")
    store.check()
    assert list(store.list()) == []
    local = LocalStore(tmp_path / "objects")
    local.check()
    assert list(local.list()) == []


def test_an_unwritable_directory_is_named(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")  # a file where the store's directory should be
    with pytest.raises(StorageUnavailable, match="cannot write to the storage directory") as info:
        LocalStore(blocker / "objects").check()
    assert not info.value.transient


def test_reachability_problems_are_transient_and_configuration_ones_are_not(
    monkeypatch, tmp_path, aws_env, s3_bucket
) -> None:
    with pytest.raises(StorageUnavailable) as missing:
        open_store("s3://no-such-bucket-here").check()
    assert not missing.value.transient
    monkeypatch.setenv("AWS_ENDPOINT_URL", UNREACHABLE)
    with pytest.raises(StorageUnavailable) as unreachable:
        open_store(f"s3://{s3_bucket}").check()
    assert unreachable.value.transient


@pytest.mark.parametrize("broken_store", ["missing bucket", "no credentials", "unreachable endpoint"], indirect=True)
def test_a_worker_with_a_storage_mistake_refuses_to_start(broken_store, tiny_model, tmp_path) -> None:
    """It names the problem and the setting to fix, and exits at once, before consuming
    anything (no model load, no queue): an unreachable endpoint is not retried at start."""
    url, words = broken_store
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_HOME=str(tmp_path / "home"), CONVEYOR_STORAGE_URL=url)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "conveyor.worker.entrypoints.cli", "worker", "--model", tiny_model],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,  # a worker that retried forever would end the test here
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("conveyor: error: ") and "\n" not in err, err
    for word in words:
        assert word in err, err
    assert "Traceback" not in proc.stderr and "celery@" not in proc.stderr
    assert elapsed < 60, f"the worker took {elapsed:.0f} s to refuse"
