"""What a new user meets first in the CLI: listing jobs, Ctrl-C during run, commands on jobs
in the wrong state, --version, help on every argument, configuration errors that name the
file or setting."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import version

import pytest
from openai.types import Batch

from conveyor.worker.entrypoints.cli import build_parser, main
from conveyor.worker.entrypoints.client import Client
from tests.worker.helpers import REPO, jsonl, openai_lines, wait_for


def _subparsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _subparsers(sub)


def test_every_argument_of_every_command_has_help() -> None:
    missing = [
        f"{parser.prog}: {action.dest}"
        for parser in _subparsers(build_parser())
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help
    ]
    assert not missing, missing


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"conveyor {version('conveyor')}"


def test_jobs_lists_newest_first_filters_by_status_and_pages(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    with Client(stack.settings) as client:
        first = client.submit(jsonl(openai_lines(2)), stack.model, enqueue=False)["id"]
        time.sleep(0.01)
        failed = client.submit(b"\n", stack.model, enqueue=False)["id"]  # no requests: failed
        time.sleep(0.01)
        cancelled = client.cancel(client.submit(jsonl(openai_lines(2)), stack.model, enqueue=False)["id"])["id"]
    assert main(["jobs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [
        [cancelled, "cancelled"],
        [failed, "failed"],
        [first, "in_progress"],
    ]
    assert main(["jobs", "--status", "failed", "--status", "cancelled", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["object"] == "list" and [Batch.model_validate(j).id for j in listed["data"]] == [cancelled, failed]
    assert main(["jobs", "--limit", "1", "--after", cancelled]) == 0
    assert capsys.readouterr().out.split()[0] == failed
    with pytest.raises(SystemExit) as info:
        main(["jobs", "--status", "nonsense"])
    assert info.value.code == 2 and "invalid choice: 'nonsense'" in capsys.readouterr().err  # argparse names them


def test_cancel_of_a_finished_job_and_results_of_a_failed_one_say_so(embedded_stack, env, capsys) -> None:
    stack = env(embedded_stack)
    with Client(stack.settings) as client:
        failed = client.submit(b"\n", stack.model, enqueue=False)["id"]
    assert main(["cancel", failed]) == 1
    assert f"conveyor: error: job {failed} already failed: there is nothing to cancel" in capsys.readouterr().err
    assert main(["results", failed]) == 1
    err = capsys.readouterr().err
    assert f"job {failed} failed before running any request" in err and "the input has no requests" in err


def test_configuration_errors_name_the_setting_or_file(embedded_stack, env, tmp_path, capsys) -> None:
    env(embedded_stack, engine_args="{bad json")
    assert main(["status", "batch_0"]) == 1
    err = capsys.readouterr().err
    assert "CONVEYOR_ENGINE_ARGS is not valid JSON" in err and "internal error" not in err
    env(embedded_stack, shard_size=20_000, max_shard_size=100)
    assert main(["status", "batch_0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "conveyor: error: invalid settings: CONVEYOR_SHARD_SIZE=20000 exceeds CONVEYOR_MAX_SHARD_SIZE=100"
    stack = env(embedded_stack)
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for item in os.listdir(stack.model):
        os.symlink(os.path.join(stack.model, item), broken / item)
    (broken / "config.json").unlink()
    (broken / "config.json").write_text('{"model_type": "llama",')
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(1)))
    assert main(["run", str(path), "--model", str(broken), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"conveyor: error: {broken / 'config.json'} is not valid JSON"), err


def test_ctrl_c_during_run_names_the_job_and_how_to_get_what_finished(embedded_stack, tmp_path) -> None:
    stack = embedded_stack
    path = tmp_path / "in.jsonl"
    # Long outputs: the job cannot finish between its start and the signal, even on a fast machine.
    path.write_bytes(jsonl(openai_lines(400, max_tokens=1900, ignore_eos=True)))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conveyor.worker.entrypoints.cli",
            "run",
            str(path),
            "--model",
            stack.model,
            "-q",
            "-o",
            "/dev/null",
        ],
        env=stack.env(shard_size=20),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    client = Client(stack.settings)
    try:
        job = wait_for(lambda: next(iter(client.jobs(["in_progress"])), None), timeout=60, what="the job to start")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert f"interrupted: job {job['id']} is cancelled" in err and f"conveyor results {job['id']}" in err
        assert "Traceback" not in err
        done = client.wait(job["id"], timeout=30)
        assert done["status"] == "cancelled"
        fetched = client.results(job["id"])  # what finished is there to fetch, as the message says
        assert not isinstance(fetched, int)
        assert len(list(fetched)) == done["request_counts"]["completed"]
    finally:
        if proc.poll() is None:
            proc.kill()
        client.close()


def test_debug_shows_the_traceback_behind_a_one_line_error(tmp_path) -> None:
    """Errors are one line; ``--debug`` (named in the docs) raises them with their traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["CONVEYOR_HOME"] = str(tmp_path / "home")
    missing = "batch_" + "0" * 32

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "conveyor.worker.entrypoints.cli", *args]
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)

    plain = cli("status", missing)
    assert plain.returncode == 1 and plain.stderr.startswith(f"conveyor: error: no job {missing} in the database ")
    assert plain.stderr.count("\n") == 1, plain.stderr
    debug = cli("--debug", "status", missing)
    assert debug.returncode == 1, debug.stderr
    assert debug.stderr.startswith("Traceback (most recent call last):"), debug.stderr
    assert f"JobNotFound: no job {missing}" in debug.stderr
    assert "`--debug`" in (REPO / "docs/user-guide/batch-jobs.md").read_text()
