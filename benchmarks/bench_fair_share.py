"""Fair shares between owners: owner B's time to its first result, alone and behind owner A's
backlog.

Real components: ``conveyor serve``'s app (uvicorn, in this process) driven by the
``openai`` SDK, PostgreSQL (127.0.0.1:5432, database ``test``, a fresh schema), Redis
(127.0.0.1:6379) as the broker, a local object store, and one real worker process
(``conveyor worker --concurrency 2``) on the tiny random-weight Llama the tests use, with
``max_num_seqs`` 4.

- ``alone``: B submits a one-line batch (8 tokens) to an idle worker, ``--reps`` times.
- ``backlog``: A submits ``--a-lines`` lines of ``--a-tokens`` tokens each (shards of 8) and,
  once A's first results are in (the worker is full), B submits the same one-line batch,
  ``--reps`` times while A's batch runs. The worker's ``/metrics`` are scraped meanwhile
  for the fair-share figures (``conveyor_fair_share_ratio``, the owners' shares).

Each B figure: seconds from ``batches.create`` returning to the batch's first completed
request (``request_counts.completed`` 1, polled every 50 ms) and to ``completed``. A B batch
not done within ``--timeout`` is reported as such (the code before the fair share: run this
file with PYTHONPATH pointing at an older checkout).

Writes JSON to benchmarks/results/fair_share.json (``--out`` for another name).

    python -m benchmarks.bench_fair_share [--reps 3] [--a-lines 400] [--a-tokens 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Final, cast

import openai
import psycopg
import uvicorn

from benchmarks.common import write_results
from conveyor.testing.tiny_models import build_tiny_model
from conveyor.worker.api.app import create_app
from conveyor.worker.core.settings import Settings
from conveyor.worker.store.api_keys import create_key
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.schema import upgrade_database

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-chat"
CHAT: Final = "/v1/chat/completions"
PG = "postgresql://{user}@127.0.0.1:5432/test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pg_user() -> str:
    for user in filter(None, (os.environ.get("PGUSER"), "postgres", "root")):
        try:
            with psycopg.connect(host="127.0.0.1", user=user, dbname="test", connect_timeout=3):
                return user
        except psycopg.Error:
            continue
    raise SystemExit("PostgreSQL at 127.0.0.1:5432/test is needed")


def batch_file(count: int, max_tokens: int, prefix: str) -> bytes:
    rows = []
    for i in range(count):
        body = {
            "model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Bring soup number {i} to table {prefix}"}],
        }  # fmt: skip
        rows.append({"custom_id": f"{prefix}-{i}", "method": "POST", "url": CHAT, "body": body})
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def scrape(port: int) -> dict[str, float]:
    """The fair-share samples of the worker's /metrics (name{labels} -> value)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    wanted = ("conveyor_fair_share", "conveyor_owner_")
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(wanted)
    }


class Stack:
    """A fresh schema, a queue prefix, the API in a thread and one worker process."""

    def __init__(self, root: Path, model: Path) -> None:
        self.schema = f"bench_fair_{uuid.uuid4().hex[:10]}"
        self.user = pg_user()
        with psycopg.connect(host="127.0.0.1", user=self.user, dbname="test", autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{self.schema}"')
        db_url = PG.format(user=self.user) + f"?options=-csearch_path%3D{self.schema}"
        upgrade_database(db_url)
        self.metrics_port = free_port()
        values: dict[str, Any] = {
            "home": str(root / "home"), "database_url": db_url, "broker_url": "redis://127.0.0.1:6379/0",
            "storage_url": (root / "objects").as_uri(), "queue_prefix": f"bf{uuid.uuid4().hex[:8]}",
            "model": str(model), "served_model_name": MODEL, "models": [MODEL], "shard_size": 8,
            "engine_args": {"num_kv_blocks": 512, "max_num_seqs": 4}, "metrics_port": self.metrics_port,
            "metrics_host": "127.0.0.1", "item_commit_interval_seconds": 0.2,
        }  # fmt: skip
        as_env = {k: json.dumps(v) if isinstance(v, (dict, list)) else str(v) for k, v in values.items()}
        self.env = {**os.environ, **{f"CONVEYOR_{k.upper()}": v for k, v in as_env.items()}}
        self.env["PYTHONPATH"] = os.environ.get("PYTHONPATH", str(REPO))
        api_only = ("model", "served_model_name", "metrics_port")
        settings = Settings(**{k: v for k, v in values.items() if k not in api_only})
        db = create_db_engine(db_url)
        self.keys = {name: create_key(db, name)[1] for name in ("owner-a", "owner-b")}
        db.dispose()
        self.log = open(root / "worker.log", "wb")  # noqa: SIM115
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "conveyor.worker.entrypoints.cli", "worker", "--concurrency=2", "--loglevel=INFO"],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.port = free_port()
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        threading.Thread(target=self.server.run, daemon=True).start()
        self._wait_ready(root / "worker.log")

    def _wait_ready(self, log: Path, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while " ready." not in log.read_text(errors="replace") or not self.server.started:
            if self.worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the worker did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)

    def client(self, owner: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=self.keys[owner], max_retries=0)

    def close(self) -> None:
        self.server.should_exit = True
        self.worker.terminate()
        try:
            self.worker.wait(15)
        except subprocess.TimeoutExpired:
            self.worker.kill()
        self.log.close()
        with psycopg.connect(host="127.0.0.1", user=self.user, dbname="test", autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


def one_line_batch(b: openai.OpenAI, timeout: float, tag: str) -> dict[str, Any]:
    """B's one-line batch: seconds to its first result and to ``completed`` (None: not within)."""
    file_id = b.files.create(file=("b.jsonl", batch_file(1, 8, tag)), purpose="batch").id
    batch_id = b.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id
    start = time.monotonic()
    first = None
    status = "validating"
    while time.monotonic() - start < timeout:
        batch = b.batches.retrieve(batch_id)
        status = batch.status
        if first is None and batch.request_counts is not None and batch.request_counts.completed >= 1:
            first = time.monotonic() - start
        if status == "completed":
            return {"first_result_s": first, "completed_s": time.monotonic() - start, "status": status}
        time.sleep(0.05)
    return {"first_result_s": first, "completed_s": None, "status": status, "timeout_s": timeout}


def progress(a: openai.OpenAI, batch_id: str) -> dict[str, Any]:
    batch = a.batches.retrieve(batch_id)
    rc = batch.request_counts
    return {"status": batch.status, "completed": rc.completed if rc else 0, "total": rc.total if rc else 0}


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) and known else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--a-lines", type=int, default=400)
    parser.add_argument("--a-tokens", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=120.0, help="how long one B batch is waited for")
    parser.add_argument("--out", default="fair_share.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fair-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "tiny-llama", "llama")
        stack = Stack(root, model)
        try:
            a, b = stack.client("owner-a"), stack.client("owner-b")
            one_line_batch(b, args.timeout, "warmup")
            alone = [one_line_batch(b, args.timeout, f"alone{i}") for i in range(args.reps)]
            print("alone:", [r["first_result_s"] for r in alone])

            big = a.files.create(file=("a.jsonl", batch_file(args.a_lines, args.a_tokens, "a")), purpose="batch")
            backlog_id = a.batches.create(
                input_file_id=big.id, endpoint=CHAT, completion_window=cast(Any, "1h")
            ).id  # (the SDK types only "24h")
            while progress(a, backlog_id)["completed"] < 4:
                time.sleep(0.2)
            behind, samples = [], []
            for i in range(args.reps):
                result = one_line_batch(b, args.timeout, f"behind{i}")
                result["a_progress"] = progress(a, backlog_id)
                behind.append(result)
                print("behind A's backlog:", result)
            done = threading.Event()

            def sample() -> None:  # the figures while B waits, and while A runs alone
                while not done.is_set():
                    with contextlib.suppress(OSError):
                        figures = scrape(stack.metrics_port)
                        if figures:  # (none from code before the fair share)
                            samples.append({"t": time.time(), **figures})
                    done.wait(0.25)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            during = one_line_batch(b, args.timeout, "sampled")
            done.set()
            sampler.join()
            a.batches.cancel(backlog_id)
        finally:
            stack.close()
    ratios = [s["conveyor_fair_share_ratio" + '{model="' + MODEL + '"}'] for s in samples]
    results = {
        "setup": {
            "worker_concurrency": 2, "max_num_seqs": 4, "shard_size": 8, "a_lines": args.a_lines,
            "a_max_tokens": args.a_tokens, "b_lines": 1, "b_max_tokens": 8, "reps": args.reps,
            "pythonpath": os.environ.get("PYTHONPATH", str(REPO)),
        },
        "alone": alone,
        "behind_backlog": behind,
        "median_first_result_s": {
            "alone": median([r["first_result_s"] for r in alone]),
            "behind_backlog": median([r["first_result_s"] for r in behind]),
        },
        "sampled_run": during,
        "fair_share_samples": samples,
        "fair_share_ratio": {"min": min(ratios), "max": max(ratios), "last": ratios[-1]} if ratios else None,
    }  # fmt: skip
    print(json.dumps(results["median_first_result_s"]), "fair_share_ratio:", results["fair_share_ratio"])
    write_results(args.out, results)


if __name__ == "__main__":
    main()
