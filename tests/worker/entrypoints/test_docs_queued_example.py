"""The docs' queued example (docs/user-guide/batch-jobs.md) works as written: its lines are run here, with only the
interpreter, CONVEYOR_HOME and the tiny model's path substituted."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

from conveyor.worker.core.settings import Settings
from conveyor.worker.entrypoints.client import Client
from tests.worker.helpers import REPO

MARKER = "<!-- queued-example -->"
PAGE = "docs/user-guide/batch-jobs.md"


def queued_example() -> list[list[str]]:
    text = (REPO / PAGE).read_text()
    assert MARKER in text, f"{PAGE} lost its queued example"
    block = re.search(r"```bash\n(.*?)```", text[text.index(MARKER) :], re.S)
    assert block is not None
    return [
        words
        for line in block.group(1).replace("\\\n", " ").splitlines()
        if (words := shlex.split(line, comments=True))
    ]


def test_the_docs_queued_example_runs_as_written(tiny_model, tmp_path) -> None:
    setup, worker, submit, status, results = queued_example()
    assert setup == ["source", ".venv/bin/activate", "&&", "export", "CONVEYOR_HOME=.cache/conveyor"]
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")} | {"CONVEYOR_HOME": str(home)}

    def argv(words: list[str], **names: str) -> list[str]:
        assert words[0] == "conveyor", words
        swapped = [tiny_model if w == ".cache/smollm2" else names.get(w, w) for w in words[1:]]
        return [sys.executable, "-m", "conveyor.worker.entrypoints.cli", *swapped]

    proc = subprocess.Popen(argv(worker), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        done = subprocess.run(argv(submit), env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.strip()
        assert re.fullmatch(r"batch_[0-9a-f]{32}", job_id), done.stdout
        with Client(Settings(home=home)) as client:
            job = client.wait(job_id, timeout=120, poll=0.2)
        assert job["status"] == "completed" and job["request_counts"]["completed"] > 0
        shown = subprocess.run(argv(status, JOB=job_id), env=env, cwd=REPO, capture_output=True, text=True)
        assert shown.returncode == 0 and job_id in shown.stdout and "completed" in shown.stdout, shown
        got = subprocess.run(argv(results, JOB=job_id), env=env, cwd=tmp_path, capture_output=True, text=True)
        assert got.returncode == 0, got.stderr
        lines = (tmp_path / "results.jsonl").read_text().splitlines()
        assert len(lines) == job["request_counts"]["completed"]
        assert all(json.loads(line)["response"]["status_code"] == 200 for line in lines)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
