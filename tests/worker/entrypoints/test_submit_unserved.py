"""``conveyor submit`` refuses a model nobody serves once the deployment names any (a live
worker or ``CONVEYOR_MODELS``), with the closest name; ``--allow-unserved`` submits anyway, and
``status`` then says no worker serves it. Through the CLI, on PostgreSQL and the broker."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.models import WorkerState
from conveyor.worker.store.workers import register_worker, set_worker_state
from tests.worker.helpers import PYTHON, REPO, Stack, jsonl, openai_lines


def test_a_typo_is_refused_with_a_suggestion_unless_allowed(pg_redis_s3_stack, env, tmp_path, capsys) -> None:
    stack = env(pg_redis_s3_stack)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(2)))
    with Client(stack.settings) as client:  # a worker serving the model as "smollm2" is live
        set_worker_state(
            client.db, register_worker(client.db, "smollm2", "q", checkpoint=stack.model), WorkerState.ready
        )
        before = client.jobs()

        assert main(["submit", str(path), "--model", "smolm2"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("conveyor: error: no live worker serves model smolm2")
        assert "served or declared: smollm2" in err and "did you mean smollm2?" in err and "--allow-unserved" in err
        assert client.jobs() == before  # no job was made

        assert main(["submit", str(path), "--model", "smolm2", "--allow-unserved", "--json"]) == 0
        captured = capsys.readouterr()
        job = json.loads(captured.out)
        assert job["model"] == "smolm2" and job["status"] == "in_progress"
        assert "no live worker serves model smolm2" in captured.err  # the warning, as before
        assert main(["status", job["id"]]) == 0
        assert "no worker has ever served model smolm2" in capsys.readouterr().out
        assert "no worker has ever served model smolm2" in _follow_stderr(stack, job["id"], tmp_path / "out.jsonl")

        assert main(["submit", str(path), "--model", "smollm2"]) == 0  # the served name itself


def test_a_declared_model_is_taken_with_no_worker_and_others_are_refused(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack, models="smollm2,qwen3")
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(2)))
    assert main(["submit", str(path), "--model", "qwen3"]) == 0
    capsys.readouterr()
    assert main(["submit", str(path), "--model", "qwen4"]) == 1
    err = capsys.readouterr().err
    assert "served or declared: qwen3, smollm2" in err and "did you mean qwen3?" in err
    assert main(["submit", str(path), "--model", stack.model]) == 1  # a checkpoint the catalog does not name


def _follow_stderr(stack: Stack, job_id: str, out: Path, want: str = "served model", seconds: float = 60) -> str:
    """What ``results --follow`` says on stderr while the job waits, until it says ``want``
    (it follows forever: it is stopped here)."""
    argv = [PYTHON, "-m", "conveyor.worker.entrypoints.cli", "results", job_id, "--follow", "-o", str(out)]
    proc = subprocess.Popen(argv, cwd=REPO, env=stack.env(), stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(iter(proc.stderr.readline, "")), daemon=True)  # type: ignore[union-attr]  # stderr is a pipe
    reader.start()
    deadline = time.monotonic() + seconds
    try:
        while not any(want in line for line in said) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(10)
    reader.join(5)
    return "".join(said)
