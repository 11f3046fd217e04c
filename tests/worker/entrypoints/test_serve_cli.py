"""``conveyor keys`` and ``conveyor serve`` as a user runs them: a key printed once, alone on
its line; a server that refuses to start without a key (or insecure off loopback); the real
``conveyor serve`` process answering the SDK."""

from __future__ import annotations

import json
import re
import subprocess
import time

import httpx2 as httpx
import openai
import pytest

from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.cli.serve import is_loopback
from conveyor.worker.store.api_keys import KEY_PREFIX, find_key
from conveyor.worker.store.database import create_db_engine
from tests.worker.helpers import PYTHON, REPO, _die_with_parent
from tests.worker.services import free_port


def test_keys_create_prints_the_key_once_alone_on_stdout(embedded_stack, env, capsys) -> None:
    stack = env(embedded_stack)
    assert main(["keys", "create", "alice"]) == 0
    out, err = capsys.readouterr()
    assert re.fullmatch(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{43}\n", out), out
    key = out.strip()
    assert "alice" in err and key not in err
    db = create_db_engine(stack.settings.database)
    try:
        assert find_key(db, key) is not None
    finally:
        db.dispose()

    assert main(["keys", "create", "alice"]) == 1
    assert "exists already" in capsys.readouterr().err
    assert main(["keys", "list", "--json"]) == 0
    listed = capsys.readouterr().out
    assert key not in listed and json.loads(listed)[0]["name"] == "alice"
    assert main(["keys", "list"]) == 0
    assert "alice" in capsys.readouterr().out
    assert main(["keys", "revoke", "alice"]) == 0
    assert "revoked" in capsys.readouterr().err
    assert main(["keys", "revoke", "bob"]) == 1
    assert capsys.readouterr().err.startswith("conveyor: error: no key named 'bob'")


def test_serve_refuses_to_start_without_a_key_or_insecure_off_loopback(embedded_stack, env, capsys) -> None:
    env(embedded_stack)
    assert main(["serve", "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert "no API key exists" in err and "conveyor keys create NAME" in err and "--insecure-no-auth" in err
    for host in ("0.0.0.0", "192.168.1.10", "::"):
        assert main(["serve", "--insecure-no-auth", "--host", host]) == 1
        assert "only on a loopback address" in capsys.readouterr().err
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "0.0.0.0", "x")] == [
        True, True, True, True, True, False, False,
    ]  # fmt: skip


def _serve(stack, *args: str, port: int) -> subprocess.Popen[bytes]:
    argv = [PYTHON, "-m", "conveyor.worker.entrypoints.cli", "serve", "--port", str(port), "--no-access-log", *args]
    return subprocess.Popen(
        argv, cwd=REPO, env=stack.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_die_with_parent
    )


def _wait_up(proc: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise AssertionError(f"conveyor serve exited {proc.returncode}: {err}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("conveyor serve did not come up")


@pytest.mark.parametrize("insecure", [False, True], ids=["with-a-key", "insecure"])
def test_the_conveyor_serve_process_answers_the_sdk(embedded_stack, env, capsys, insecure: bool) -> None:
    stack = env(embedded_stack)
    key = "anything"
    if not insecure:
        assert main(["keys", "create", "alice"]) == 0
        key = capsys.readouterr().out.strip()
    port = free_port()
    proc = _serve(stack, *(["--insecure-no-auth"] if insecure else []), port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_up(proc, url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        uploaded = client.files.create(file=("a.jsonl", b'{"prompt": "hi"}\n'), purpose="batch")
        assert [f.id for f in client.files.list()] == [uploaded.id]
        if not insecure:
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).files.list()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    text = err.decode()
    assert "OpenAI-compatible API at" in text and ("insecure" in text) == insecure
    assert "taking broker submissions from t" in text  # (the test's queue prefix starts with t)
    assert key not in text  # never logged
