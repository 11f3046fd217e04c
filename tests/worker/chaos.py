"""A whole deployment on private services, and the faults a chaos run injects into it.

``ChaosDeployment`` starts PostgreSQL, Redis and moto's S3 of its own (``private_services``),
``conveyor serve`` (whose ``/metrics`` exports the demand) and the KEDA-like ``Autoscaler`` of
``autoscaler.py`` starting real ``conveyor worker`` processes, at most ``max_workers``. The
autoscaler reads ``conveyor_demand`` straight from the API server's ``/metrics`` (no Prometheus
server needed; a failed scrape holds the replica count, as KEDA does with a failed query).

``FAULTS`` names what ``inject(kind)`` does; each returns when the fault is over (the service
restored), so the caller can time the recovery from there. Used by ``benchmarks/bench_faults.py``
(the soak) and ``tests/worker/faults/test_chaos.py`` (one of each on a small job).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from conveyor.worker.store.api_keys import create_key
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Item, Shard
from conveyor.worker.store.schema import upgrade_database
from tests.worker.autoscaler import Autoscaler, Pod, scaled_object_trigger
from tests.worker.helpers import PYTHON, REPO, Stack, WorkerProc, _die_with_parent, make_values, scrape
from tests.worker.private_services import PrivatePostgres, PrivateRedis, PrivateS3
from tests.worker.services import free_port

FAULTS = ("worker_sigkill", "worker_sigterm", "redis_restart", "postgres_restart", "s3_outage", "api_killed")
MODEL = "tiny-chat"
TIME_SCALE = 0.01  # the manifests' durations, a hundred times faster (drain 300 s -> 3 s)


class DemandReader:
    """What the autoscaler asks Prometheus, answered from the API server's ``/metrics``."""

    def __init__(self, port: int) -> None:
        self.port = port

    def query(self, expr: str) -> float | None:
        found = scrape(self.port, timeout=3).find("conveyor_demand", model=MODEL)
        return max(s.value for s in found) if found else None


@dataclasses.dataclass
class FaultRecord:
    kind: str
    started: float  # time.monotonic()
    restored: float
    detail: str = ""
    stored_at_restore: int = 0
    recovered: float | None = None  # the first moment past ``restored`` when items were stored again
    # Tokens generated and not stored (``ChaosDeployment.unstored_tokens``) as the fault began,
    # and as the next one began (or the job ended): the difference is what was computed twice.
    unstored_before: float = 0.0
    unstored_after: float | None = None

    @property
    def tokens_computed_twice(self) -> float | None:
        return None if self.unstored_after is None else round(self.unstored_after - self.unstored_before, 1)

    def as_dict(self, t0: float) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "at_s": round(self.started - t0, 2),
            "outage_s": round(self.restored - self.started, 2),
            "recovery_s": None if self.recovered is None else round(self.recovered - self.restored, 2),
            "tokens_computed_twice": self.tokens_computed_twice,
            "detail": self.detail,
        }


class ChaosDeployment:
    def __init__(
        self,
        workdir: Path,
        model_path: str,
        *,
        max_workers: int = 3,
        concurrency: int = 2,
        engine_args: dict[str, Any] | None = None,
        **values: Any,
    ) -> None:
        self.workdir = workdir
        self.postgres = PrivatePostgres()
        try:
            self.redis = PrivateRedis(workdir / "redis")
            self.s3 = PrivateS3()
            upgrade_database(self.postgres.url)
            stack_values = make_values(
                workdir / "home", model_path, database_url=self.postgres.url, broker_url=self.redis.url,
                storage_url=f"s3://{self.s3.bucket}/conveyor", served_model_name=MODEL, models=[MODEL],
                worker_concurrency=concurrency, metrics_cache_seconds=0.25, worker_live_seconds=5.0,
                engine_args=engine_args or {"num_kv_blocks": 512, "max_num_seqs": 64},
                dependency_backoff_max_seconds=1.0, dependency_retry_seconds=5.0, **values,
            )  # fmt: skip
            self.stack = Stack(stack_values, MODEL, self.s3.env())
            self._saved_env = {k: os.environ.get(k) for k in self.s3.env()}
            os.environ.update(self.s3.env())  # this process's own Client reads S3 through the proxy too
            self.db = create_db_engine(self.postgres.url)
            self.api_key = create_key(self.db, "chaos")[1]
            self.api_port = free_port()
            self.api: subprocess.Popen | None = None
            self.start_api()
            trigger = dataclasses.replace(
                scaled_object_trigger(TIME_SCALE), max_replicas=max_workers, threshold=float(concurrency),
                concurrency=concurrency,
            )  # fmt: skip
            self.metrics_ports: dict[int, int] = {}  # worker pid -> its metrics port
            # worker pid -> its engine's generated tokens when last scraped (kept once it is gone)
            self.tokens: dict[int, float] = {}
            self.autoscaler = Autoscaler(DemandReader(self.api_port), trigger, MODEL, self._spawn)  # type: ignore[arg-type]
            self.rng = random.Random(0)
        except BaseException:  # a failed start leaves no server running (pg_ctl's outlives us)
            for name in ("api", "s3", "redis", "postgres"):
                with contextlib.suppress(Exception):
                    getattr(self, name).kill() if name == "api" else getattr(self, name).close()
            raise

    # ---- processes ------------------------------------------------------------------------

    def _spawn(self, args: tuple[str, ...]) -> WorkerProc:
        log = self.workdir / f"worker-{len(self.autoscaler.pods)}.log"
        port = free_port()
        proc = WorkerProc(
            self.stack.env(metrics_port=port), log, concurrency=self.autoscaler.trigger.concurrency, extra_args=args
        )
        self.metrics_ports[proc.pid] = port
        return proc

    def start_api(self) -> None:
        argv = [
            PYTHON,
            "-m",
            "conveyor.worker.entrypoints.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.api_port),
        ]
        with open(self.workdir / "api.log", "ab") as log:
            self.api = subprocess.Popen(
                [*argv, "--no-access-log"], cwd=REPO, env=self.stack.env(), stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            url = f"http://127.0.0.1:{self.api_port}/healthz"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
            if self.api.poll() is not None:
                raise RuntimeError(f"the API server exited: {(self.workdir / 'api.log').read_text()[-2000:]}")
            time.sleep(0.2)
        raise RuntimeError("the API server did not come up")

    def kill_api(self) -> None:
        if self.api is not None and self.api.poll() is None:
            os.killpg(self.api.pid, 9)
            self.api.wait(10)

    def live_workers(self) -> list[Pod]:
        return [p for p in self.autoscaler.live() if p.terminated_at is None and p.ready_at is not None]

    # ---- observation ----------------------------------------------------------------------

    def stored(self, job_id: str) -> int | None:
        """Item rows stored for the job; None while the database cannot be reached."""
        try:
            with self.db.connect() as conn:
                return conn.execute(select(func.count()).select_from(Item).where(Item.job_id == job_id)).scalar_one()
        except Exception:
            return None

    def generated_tokens(self, pods: list[Pod] | None = None) -> float:
        """Every worker's ``conveyor_engine_generated_tokens_total`` (what its engine computed)
        added up: ``pods`` (all live ones by default) scraped now, the others as last seen. A
        worker about to be stopped is scraped just before, so that what it computed is known."""
        for pod in self.autoscaler.live() if pods is None else pods:
            port = self.metrics_ports.get(pod.proc.pid)
            if port is None:
                continue
            with contextlib.suppress(Exception):
                samples = scrape(port, timeout=2).find("conveyor_engine_generated_tokens_total")
                self.tokens[pod.proc.pid] = sum(s.value for s in samples)
        return sum(self.tokens.values())

    def stored_tokens(self, job_id: str) -> int | None:
        """The completion tokens of the job's stored items; None while the database is down."""
        try:
            with self.db.connect() as conn:
                return int(
                    conn.execute(
                        select(func.coalesce(func.sum(Item.completion_tokens), 0)).where(Item.job_id == job_id)
                    ).scalar_one()
                )
        except Exception:
            return None

    def unstored_tokens(self, job_id: str) -> float:
        """Tokens the engines generated that are not in a stored item: the ones computed twice
        (or thrown away) so far, plus those of items finished and not committed yet (at most
        ``item_commit_interval_seconds`` of work: the noise of one reading)."""
        generated = self.generated_tokens()
        while (stored := self.stored_tokens(job_id)) is None:  # the database may be coming back
            time.sleep(0.2)
        return generated - stored

    def shard_totals(self, job_id: str) -> dict[str, int]:
        with self.db.connect() as conn:
            deaths, failures, attempts, shards = conn.execute(
                select(func.sum(Shard.deaths), func.sum(Shard.failures), func.sum(Shard.attempts), func.count()).where(
                    Shard.job_id == job_id
                )
            ).one()
        return {"deaths": int(deaths or 0), "failures": int(failures or 0), "attempts": int(attempts or 0),
                "shards": int(shards)}  # fmt: skip

    # ---- faults ---------------------------------------------------------------------------

    def inject(self, kind: str, *, max_outage_s: float = 60.0) -> FaultRecord:
        """One fault; returns once it is over (what was stopped is running again)."""
        start = time.monotonic()
        detail = ""
        if kind in ("worker_sigkill", "worker_sigterm"):
            deadline = time.monotonic() + 120
            while not (live := self.live_workers()) and time.monotonic() < deadline:
                self.autoscaler._observe()  # the autoscaler is replacing one: wait for it
                time.sleep(0.2)
            if not live:
                return FaultRecord(kind, start, time.monotonic(), "no ready worker to stop")
            start = time.monotonic()
            pod = self.rng.choice(live)
            detail = f"pid {pod.proc.pid}"
            self.generated_tokens([pod])
            if kind == "worker_sigkill":
                pod.proc.kill9()
            else:  # a spot interruption: the autoscaler's stop, SIGTERM then SIGKILL after the grace period
                self.autoscaler._terminate(pod)
                while pod.alive:
                    self.generated_tokens([pod])  # while it drains
                    self.autoscaler._observe()
                    time.sleep(0.2)
                detail += " killed after the grace period" if pod.killed else f" drained, exit {pod.returncode}"
        elif kind == "redis_restart":
            self.redis.restart_empty()
        elif kind == "postgres_restart":
            self.postgres.stop()
            time.sleep(self.rng.uniform(2.0, min(10.0, max_outage_s)))
            self.postgres.start()
        elif kind == "s3_outage":
            outage = self.rng.uniform(min(5.0, max_outage_s), max_outage_s)
            detail = f"{outage:.0f} s refused"
            with self.s3.proxy.outage():
                time.sleep(outage)
        elif kind == "api_killed":
            self.kill_api()
            time.sleep(1.0)
            self.start_api()
        else:
            raise ValueError(f"unknown fault {kind!r}; one of {', '.join(FAULTS)}")
        return FaultRecord(kind, start, time.monotonic(), detail)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.autoscaler.stop()
        self.kill_api()
        self.db.dispose()
        for service in (self.s3, self.redis, self.postgres):
            with contextlib.suppress(Exception):
                service.close()
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclasses.dataclass
class ChaosRun:
    """What one job under faults did: the faults, its duration, and the exactly-once check."""

    job_id: str
    lines: int
    seconds: float
    faults: list[FaultRecord]
    status: str
    request_counts: dict[str, int]
    results_in_order: bool  # the results file holds each custom_id once, in input order
    errors_lines: int
    duplicated: int  # item rows beyond one per custom_id
    lost: int  # lines with no item row
    tokens_generated: float  # what the workers' engines counted (each scraped last just before it stopped)
    tokens_stored: int
    shards: dict[str, int]
    max_workers_seen: int
    t0: float

    @property
    def exactly_once(self) -> bool:
        return (
            self.status == "completed"
            and self.request_counts.get("completed") == self.lines
            and self.request_counts.get("failed") == 0
            and self.results_in_order
            and self.errors_lines == 0
            and self.duplicated == 0
            and self.lost == 0
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "lines": self.lines, "seconds": round(self.seconds, 2),
            "items_per_s": round(self.lines / self.seconds, 1), "status": self.status,
            "request_counts": self.request_counts, "results_in_order": self.results_in_order,
            "errors_lines": self.errors_lines, "duplicated": self.duplicated, "lost": self.lost,
            "exactly_once": self.exactly_once, "tokens_generated": self.tokens_generated,
            "tokens_stored": self.tokens_stored,
            "tokens_computed_twice": round(self.tokens_generated - self.tokens_stored, 1),
            "shards": self.shards, "max_workers_seen": self.max_workers_seen,
            "faults": [f.as_dict(self.t0) for f in self.faults],
        }  # fmt: skip


def job_lines(n: int, max_tokens: int = 2) -> list[dict[str, Any]]:
    """``n`` short greedy chat lines, ``req-0``...: the engine is not what is measured."""
    return [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": f"n{i}"}], "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True}}
        for i in range(n)
    ]  # fmt: skip


def run_job_under_faults(
    dep: ChaosDeployment,
    n: int,
    *,
    shard_size: int,
    max_tokens: int = 2,
    schedule: list[str] | None = None,
    interval_s: tuple[float, float] = (10.0, 30.0),
    duration_s: float = 600.0,
    max_outage_s: float = 60.0,
    timeout_s: float = 1800.0,
    log: Any = print,
) -> ChaosRun:
    """Submit an ``n``-line job and inject faults every ``interval_s`` while it runs: ``schedule``
    in order, or ``FAULTS`` in random order (each once per round) until ``duration_s`` passed or the job is done;
    then wait for it (at most ``timeout_s``) and check every line is answered exactly once."""
    import json

    from conveyor.worker.entrypoints.client import Client

    if dep.autoscaler._thread is None:
        dep.autoscaler.start()
    client = Client(dep.stack.settings)
    body = b"".join(json.dumps(line).encode() + b"\n" for line in job_lines(n, max_tokens))
    t0 = time.monotonic()
    job_id = client.submit(body, MODEL, shard_size=shard_size)["id"]
    faults: list[FaultRecord] = []
    max_workers = 0
    pending = list(schedule) if schedule is not None else None
    bag: list[str] = []
    while not dep.stored(job_id):  # faults begin once the job is under way
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"job {job_id} stored nothing in {timeout_s} s")
        time.sleep(0.2)
    next_at = time.monotonic() + dep.rng.uniform(*interval_s)

    def observe() -> int | None:
        nonlocal max_workers
        stored = dep.stored(job_id)
        dep.generated_tokens()
        max_workers = max(max_workers, len(dep.live_workers()))
        for fault in faults:
            if fault.recovered is None and stored is not None and stored > fault.stored_at_restore:
                fault.recovered = time.monotonic()
        return stored

    def done() -> bool:
        stored = observe()
        return stored == n and _status(dep, job_id) == "completed"

    while not done():
        now = time.monotonic()
        more = pending if pending is not None else (now - t0 < duration_s)
        if more and now >= next_at:
            if pending is None and not bag:  # random order, each kind once per round of six
                bag = dep.rng.sample(FAULTS, len(FAULTS))
            kind = pending.pop(0) if pending is not None else bag.pop()
            log(f"[{now - t0:7.1f} s] fault {kind}, {dep.stored(job_id)} of {n} stored")
            unstored = dep.unstored_tokens(job_id)
            if faults:
                faults[-1].unstored_after = unstored
            fault = dep.inject(kind, max_outage_s=max_outage_s)
            fault.unstored_before = unstored
            stored = None
            while stored is None:  # the database may still be coming back
                stored = dep.stored(job_id)
                time.sleep(0.2)
            fault.stored_at_restore = stored
            faults.append(fault)
            log(f"[{time.monotonic() - t0:7.1f} s]   over ({fault.detail or 'restored'})")
            next_at = time.monotonic() + dep.rng.uniform(*interval_s)
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"job {job_id} not completed after {timeout_s} s: {dep.stored(job_id)} of {n} stored")
        time.sleep(0.5)
    seconds = time.monotonic() - t0
    if faults:
        faults[-1].unstored_after = dep.unstored_tokens(job_id)
    job = client.status(job_id)
    ids = [json.loads(line)["custom_id"] for line in client.result_bytes(job_id)]
    errors = sum(1 for _ in client.result_bytes(job_id, errors=True))
    with dep.db.connect() as conn:
        per_item = dict(
            conn.execute(
                select(Item.custom_id, func.count()).where(Item.job_id == job_id).group_by(Item.custom_id)
            ).all()
        )
    client.close()
    return ChaosRun(
        job_id=job_id, lines=n, seconds=seconds, faults=faults, status=job["status"],
        request_counts=job["request_counts"], results_in_order=ids == [f"req-{i}" for i in range(n)],
        errors_lines=errors, duplicated=sum(c - 1 for c in per_item.values()),
        lost=n - len(per_item), tokens_generated=dep.generated_tokens(), tokens_stored=dep.stored_tokens(job_id) or 0,
        shards=dep.shard_totals(job_id), max_workers_seen=max_workers, t0=t0,
    )  # fmt: skip


def _status(dep: ChaosDeployment, job_id: str) -> str | None:
    from conveyor.worker.store.models import Job

    try:
        with dep.db.connect() as conn:
            return conn.execute(select(Job.status).where(Job.id == job_id)).scalar_one()
    except Exception:
        return None
