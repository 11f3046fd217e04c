"""The HTTP API under load: requests/s of ``GET /v1/batches/{id}`` with a real key, and the
memory of the server process while it takes a 1 GiB upload.

Each case starts the real ``conveyor serve`` in a subprocess (one uvicorn process) on
embedded defaults (SQLite, a local object store) and, when PostgreSQL answers on
127.0.0.1:5432 (database ``test``), on PostgreSQL. A worker is only registered as serving
the batch's model (none runs: the batch stays ``validating``, which costs a GET what a
finished batch costs: the key's lookup and the job's row).

- Polling: ``--threads`` client threads (one keep-alive connection each, in this process)
  call ``GET /v1/batches/{id}`` for ``--seconds``; requests/s and latency percentiles.
- Upload: a 1 GiB batch file (OpenAI Batch lines), generated on the fly and streamed as a
  chunked multipart body (nothing of it held by the client either); the server's resident
  memory before, its peak while the upload ran (sampled every 50 ms, and the kernel's
  high-water mark ``VmHWM``), and the upload's rate.

Writes JSON to benchmarks/results/api.json.

    python -m benchmarks.bench_api [--seconds 10] [--threads 8] [--upload-mib 1024] [--quick]
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
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx

from benchmarks.common import write_results
from conveyor.worker.core.settings import Settings
from conveyor.worker.store.api_keys import create_key
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import WorkerState
from conveyor.worker.store.schema import ensure_schema, upgrade_database
from conveyor.worker.store.workers import register_worker, set_worker_state

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-model"
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    return out


def batch_line(i: int) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Bring soup number {i} to the guest"}]}
    return json.dumps({"custom_id": f"r-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode()


class Server:
    """``conveyor serve`` in a subprocess, with one key and a registered worker for MODEL."""

    def __init__(self, env: dict[str, str], settings: Settings) -> None:
        db = create_db_engine(settings.database)
        try:
            ensure_schema(settings, db)
            self.key = create_key(db, f"bench-{uuid.uuid4().hex[:8]}")[1]
            set_worker_state(db, register_worker(db, MODEL, "bench", checkpoint="none"), WorkerState.ready)
        finally:
            db.dispose()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "conveyor.worker.entrypoints.cli",
            "serve",
            "--port",
            str(self.port),
            "--no-access-log",
        ]
        argv += ["--loglevel", "warning"]
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("conveyor serve did not start")
            time.sleep(0.1)
        self.headers = {"Authorization": f"Bearer {self.key}"}

    def create_batch(self) -> str:
        files = {"file": ("in.jsonl", b"\n".join(batch_line(i) for i in range(10)) + b"\n")}
        uploaded = httpx.post(f"{self.url}/v1/files", headers=self.headers, data={"purpose": "batch"}, files=files)
        uploaded.raise_for_status()
        created = httpx.post(
            f"{self.url}/v1/batches",
            headers=self.headers,
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        return str(created.json()["id"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def poll_load(server: Server, batch_id: str, *, threads: int, seconds: float) -> dict[str, Any]:
    url = f"{server.url}/v1/batches/{batch_id}"
    latencies: list[list[float]] = [[] for _ in range(threads)]
    errors = [0] * threads
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        with httpx.Client(headers=server.headers, timeout=30) as client:
            client.get(url)  # connect (and warm up) before the clock counts
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                answer = client.get(url)
                latencies[i].append(time.perf_counter() - t0)
                if answer.status_code != 200:
                    errors[i] += 1

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - t0
    all_lat = sorted(x for lat in latencies for x in lat)
    n = len(all_lat)
    return {
        "requests": n,
        "errors": sum(errors),
        "seconds": elapsed,
        "requests_per_s": n / elapsed,
        "latency_ms": {
            "mean": 1000 * statistics.fmean(all_lat),
            "p50": 1000 * all_lat[n // 2],
            "p99": 1000 * all_lat[min(n - 1, int(n * 0.99))],
        },
        "client_threads": threads,
    }


def upload_load(server: Server, size: int) -> dict[str, Any]:
    boundary = "bench-boundary"
    lines = b"".join(batch_line(i) + b"\n" for i in range(256))
    sent = [0]

    def body() -> Iterator[bytes]:
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode()
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'.encode()
        while sent[0] + len(lines) <= size:
            yield lines
            sent[0] += len(lines)
        yield f"\r\n--{boundary}--\r\n".encode()

    pid = server.proc.pid
    before = proc_status(pid)
    peak = [before["VmRSS"]]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            with contextlib.suppress(OSError, KeyError):
                peak[0] = max(peak[0], proc_status(pid)["VmRSS"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    headers = {**server.headers, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    t0 = time.perf_counter()
    answer = httpx.post(f"{server.url}/v1/files", content=body(), headers=headers, timeout=3600)
    elapsed = time.perf_counter() - t0
    done.set()
    sampler.join()
    after = proc_status(pid)
    answer.raise_for_status()
    scan = answer.json()
    return {
        "bytes": sent[0],
        "stored_bytes": scan["bytes"],
        "seconds": elapsed,
        "mib_per_s": sent[0] / MiB / elapsed,
        "server_rss_before_mib": before["VmRSS"] / MiB,
        "server_rss_peak_sampled_mib": peak[0] / MiB,
        "server_rss_after_mib": after["VmRSS"] / MiB,
        "server_vmhwm_after_mib": after["VmHWM"] / MiB,
    }


@contextlib.contextmanager
def postgres_url() -> Iterator[str | None]:
    """A fresh schema on the local PostgreSQL, dropped after; None if it does not answer."""
    try:
        import psycopg

        admin = psycopg.connect(host="127.0.0.1", port=5432, user="postgres", dbname="test", autocommit=True)
    except Exception:
        yield None
        return
    schema = f"conveyor_bench_{uuid.uuid4().hex[:10]}"
    with admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
        try:
            yield f"postgresql://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{schema}"
        finally:
            admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def case_env(home: Path, database_url: str | None, upload_limit: int) -> tuple[dict[str, str], Settings]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(
        CONVEYOR_HOME=str(home), CONVEYOR_MAX_UPLOAD_BYTES=str(upload_limit), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"
    )
    if database_url:
        env["CONVEYOR_DATABASE_URL"] = database_url
        upgrade_database(database_url)
    return env, Settings(home=home, database_url=database_url, max_upload_bytes=upload_limit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--upload-mib", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="2 s of polling, a 64 MiB upload")
    args = ap.parse_args()
    seconds, upload_mib = (2.0, 64) if args.quick else (args.seconds, args.upload_mib)
    results: dict[str, Any] = {"poll": {}, "upload": None}
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-api-") as tmp, postgres_url() as pg:
        for name, url in (("sqlite", None), ("postgresql", pg)):
            if name == "postgresql" and url is None:
                print("postgresql: not reachable on 127.0.0.1:5432, skipped")
                continue
            env, settings = case_env(Path(tmp) / name, url, upload_limit=2 * upload_mib * MiB)
            server = Server(env, settings)
            try:
                batch_id = server.create_batch()
                res = poll_load(server, batch_id, threads=args.threads, seconds=seconds)
                results["poll"][name] = res
                lat = res["latency_ms"]
                print(
                    f"GET /v1/batches/{{id}} on {name}: {res['requests_per_s']:,.0f} req/s "
                    f"(p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms, {args.threads} client threads, "
                    f"{res['errors']} errors)"
                )
                if name == "sqlite":
                    up = upload_load(server, upload_mib * MiB)
                    results["upload"] = up
                    print(
                        f"upload of {up['bytes'] / MiB:,.0f} MiB: {up['mib_per_s']:.0f} MiB/s; server RSS "
                        f"{up['server_rss_before_mib']:.0f} MiB before, {up['server_rss_peak_sampled_mib']:.0f} MiB "
                        f"peak while uploading (VmHWM {up['server_vmhwm_after_mib']:.0f} MiB)"
                    )
            finally:
                server.stop()
    results["notes"] = (
        "one uvicorn process; the load generator runs on the same machine (its threads share the CPU with "
        "the server); the upload is a purpose=batch file, scanned while it streams"
    )
    write_results("api.json", results)


if __name__ == "__main__":
    main()
