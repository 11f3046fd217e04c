"""``pip install conveyor`` without the worker extra: ``conveyor --help`` works and every command
says, in one line, which extra to install. The extra's modules are hidden from a fresh
interpreter by an import hook, as if they were not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor.worker.entrypoints import cli
from conveyor.worker.entrypoints.cli.extra import missing_extra
from conveyor.worker.entrypoints.cli.options import JOB_STATUSES
from conveyor.worker.store.models import JobStatus
from tests.worker.helpers import REPO

pytestmark = pytest.mark.subprocess  # each test runs conveyor in a fresh interpreter

HIDE = """
import sys
from importlib.abc import MetaPathFinder

class Hidden(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"kombu", "celery", "sqlalchemy", "alembic", "boto3", "pydantic_settings"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hidden())
from conveyor.worker.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


def conveyor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_help_works_without_the_worker_extra() -> None:
    done = conveyor("--help")
    assert done.returncode == 0, done.stderr
    assert "submit" in done.stdout and "worker" in done.stdout and "serve" in done.stdout
    sub = conveyor("submit", "--help")
    assert sub.returncode == 0 and "--completion-window" in sub.stdout, sub.stderr


def test_a_command_that_needs_the_extra_says_which_in_one_line() -> None:
    for args, shown in (
        (["jobs"], "jobs"),
        (["keys", "list"], "keys list"),
        (["submit", "x.jsonl", "--model", "m"], "submit"),
    ):
        done = conveyor(*args)
        assert done.returncode == 1
        assert done.stderr == (
            f"conveyor: error: 'conveyor {shown}' needs the worker extra (kombu is not installed): "
            "pip install 'conveyor[worker]'\n"
        ), done.stderr
        assert "Traceback" not in done.stderr


def test_the_parsers_choices_are_the_models_with_the_extra() -> None:
    parser = cli.build_parser()
    assert missing_extra() is None
    assert [s.value for s in JobStatus] == JOB_STATUSES
    assert parser.parse_args(["jobs", "--status", "expired"]).status == ["expired"]
