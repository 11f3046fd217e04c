"""Helpers for the worker tests: per-test settings, worker subprocesses, inputs, results."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from sqlalchemy import func, select

from conveyor.worker.batchio.records import LineError, ParsedRequest
from conveyor.worker.core.settings import Settings
from conveyor.worker.store.models import Item, ItemStatus
from conveyor.worker.store.objects.base import ObjectStore

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

# Fast fault handling for tests: a dead worker's shard is taken over within a few seconds.
FAST = {
    "lease_seconds": 3.0,
    "heartbeat_seconds": 0.5,
    "sweep_interval_seconds": 0.5,
    "cancel_poll_seconds": 0.2,
    "item_commit_interval_seconds": 0.2,
    "snapshot_interval_seconds": 0.5,
    "shard_size": 4,
    "worker_concurrency": 2,
    # Most tests name a shard by its line range; the tests of prefix grouping opt in.
    "shard_order": "input",
}
ENGINE = {"num_kv_blocks": 512, "max_num_seqs": 64}


@dataclass
class Stack:
    """One test's isolated services: the settings, and the same as environment variables."""

    values: dict[str, Any]
    model: str
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def settings(self) -> Settings:
        return Settings(**self.values)

    def env(self, **overrides: Any) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
        values = {**self.values, **overrides}
        for name, value in values.items():
            if value is None:
                continue
            env[f"CONVEYOR_{name.upper()}"] = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
        env.update(self.extra_env)
        env["PYTHONPATH"] = str(REPO)
        env.setdefault("TRITON_INTERPRET", "1")
        return env

    def with_values(self, **overrides: Any) -> Stack:
        return Stack({**self.values, **overrides}, self.model, dict(self.extra_env))


def make_values(home: Path, model: str, **overrides: Any) -> dict[str, Any]:
    return {
        "home": str(home),
        "model": model,
        "queue_prefix": f"t{uuid.uuid4().hex[:10]}",
        "engine_args": dict(ENGINE),
        **FAST,
        **overrides,
    }


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it if the test process dies (no orphans)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.setsid()


class WorkerProc:
    """A worker in a subprocess (``conveyor worker`` or plain ``celery -A conveyor.worker.app worker``)."""

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        *,
        plain_celery: bool = False,
        concurrency: int = 2,
        extra_args: Sequence[str] = (),
    ) -> None:
        if plain_celery:
            args = [
                "celery",
                "-A",
                "conveyor.worker.app",
                "worker",
                "--loglevel=INFO",
                "--without-mingle",
                "--without-gossip",
            ]
        else:
            args = ["conveyor.worker.entrypoints.cli", "worker", f"--concurrency={concurrency}", "--loglevel=INFO"]
        argv = [PYTHON, "-m", *args, *extra_args]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.log():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        raise AssertionError(f"worker not ready after {timeout} s:\n{self.log()[-3000:]}")

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        """Ask for a warm shutdown (SIGTERM to its process group)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, grace: float = 1.5) -> None:
        """SIGTERM, then SIGKILL whatever is left after ``grace`` seconds."""
        self.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def openai_lines(
    n: int,
    *,
    max_tokens: int = 8,
    ignore_eos: bool = False,
    prefix: str = "req",
    url: str = "/v1/chat/completions",
) -> list[dict[str, Any]]:
    """``n`` greedy OpenAI Batch lines to one endpoint (as a batch file must hold)."""
    lines = []
    for i in range(n):
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0}
        if ignore_eos:
            body["ignore_eos"] = True
        if url == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": f"Bring soup number {i} to the guest"}]
        else:
            body["prompt"] = f"The chef cooks dish {i} and"
        lines.append({"custom_id": f"{prefix}-{i}", "method": "POST", "url": url, "body": body})
    return lines


def read_object(store: ObjectStore, key: str) -> bytes:
    """A whole stored object (tests only: production code streams)."""
    with store.open_read(key) as f:
        return f.read()


def jsonl(rows: list[Any]) -> bytes:
    return b"".join((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows)


def parse_lines(lines: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines]


def as_request(row: ParsedRequest | LineError) -> ParsedRequest:
    """``row`` from ``iter_input``, checked to be a parsed request."""
    assert isinstance(row, ParsedRequest), row
    return row


def as_line_error(row: ParsedRequest | LineError) -> LineError:
    """``row`` from ``iter_input``, checked to be a rejected line."""
    assert isinstance(row, LineError), row
    return row


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def stored_items(db: Any, job_id: str) -> int:
    """Item rows stored for a job so far."""
    with db.connect() as conn:
        return conn.execute(select(func.count()).select_from(Item).where(Item.job_id == job_id)).scalar_one()


def assert_each_request_once(client: Any, db: Any, job: dict[str, Any], n: int) -> None:
    """``job`` (finished) completed with each of its ``n`` requests (``req-0``...) succeeded and
    stored exactly once: one item row each, results in input order, no errors-file line."""
    job_id = job["id"]
    assert job["status"] == "completed", job
    assert job["request_counts"] == {"total": n, "completed": n, "failed": 0}
    ids = [r["custom_id"] for r in parse_lines(client.results(job_id))]
    assert ids == [f"req-{i}" for i in range(n)]  # each exactly once, in input order
    assert parse_lines(client.results(job_id, errors=True)) == []
    with db.connect() as conn:
        per_item = conn.execute(
            select(Item.custom_id, func.count()).where(Item.job_id == job_id).group_by(Item.custom_id)
        ).all()
        statuses = set(conn.execute(select(Item.status).where(Item.job_id == job_id)).scalars())
    assert len(per_item) == n and {count for _, count in per_item} == {1}
    assert statuses == {ItemStatus.succeeded}


@dataclass
class Scrape:
    """One scrape of a ``/metrics`` endpoint, parsed by ``prometheus_client``'s parser."""

    status: int
    content_type: str
    samples: list[Sample]

    @classmethod
    def parse(cls, text: str, status: int = 200, content_type: str = "") -> Scrape:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        return cls(status, content_type, samples)

    def find(self, name: str, **labels: str) -> list[Sample]:
        """The samples called ``name`` whose labels include ``labels``."""
        return [s for s in self.samples if s.name == name and labels.items() <= s.labels.items()]

    def value(self, name: str, **labels: str) -> float:
        """The one sample called ``name`` with these labels (AssertionError if not exactly one)."""
        found = self.find(name, **labels)
        assert len(found) == 1, f"{len(found)} samples {name}{labels}: {found}"
        return found[0].value


def scrape(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> Scrape:
    """GET ``http://host:port/metrics`` and parse it."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
        return Scrape.parse(resp.read().decode(), resp.status, resp.headers.get("Content-Type", ""))


# Engine arguments that make a tiny model's job take a while (one sequence at a time), so that a
# test can act on it while it runs.
SLOW_ENGINE = {"num_kv_blocks": 512, "max_num_seqs": 1}


def record_engine_builds(monkeypatch: Any) -> list[Any]:
    """The ``EngineConfig`` of every engine host built from now on, in order; the engine is
    still built, by the real ``EngineHost.from_config``."""
    from conveyor.worker.execution.engine_host import EngineHost

    seen: list[Any] = []
    build = EngineHost.from_config.__func__  # type: ignore[attr-defined]

    def recording(cls: Any, config: Any, **kwargs: Any) -> Any:
        seen.append(config)
        return build(cls, config, **kwargs)

    monkeypatch.setattr(EngineHost, "from_config", classmethod(recording))
    return seen
