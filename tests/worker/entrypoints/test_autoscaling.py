"""Scaling from zero, as a deployment runs it: nothing but ``conveyor serve`` at first, a real
Prometheus server scraping its ``/metrics``, and an autoscaler that follows KEDA's rules with
the trigger, cooldown and worker flags read from ``infra/k8s`` (``tests/worker/autoscaler.py``;
durations scaled by ``TIME_SCALE``), starting real ``conveyor worker`` processes.

- Every door wakes a worker from zero within ``WAKE_SECONDS`` and its job completes with every
  line exactly once: a batch through the official ``openai`` SDK, a plain kombu producer's
  message sent twice (one job, one announcement), and ``conveyor submit``. The workers are
  scaled back to zero after the cooldown and exit 0, never killed.
- A burst scales to two workers and back to zero: the worker scaled in while it runs shards
  drains, hands them back, and exits 0 within its drain time; the other finishes them. (Its
  two jobs are long on purpose: the first must still run when the second worker is ready.)
- The ScaledJob mode: a run-to-completion worker started from zero exits 0 by itself.

PostgreSQL, RabbitMQ and Prometheus (``.ci/services.sh`` installs Debian's ``prometheus`` on CI)
are real; a missing one skips these tests (fails them with ``CI=true``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import func, select

from conveyor.worker.broker.queues import intake_queue_name, queue_name, submit_queue_name
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.api_keys import create_key
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Job, Shard, ShardStatus
from conveyor.worker.store.schema import upgrade_database
from tests.worker.autoscaler import (
    Autoscaler,
    Pod,
    Prometheus,
    prometheus_binary,
    scaled_job_trigger,
    scaled_object_trigger,
)
from tests.worker.broker_messages import drain, load_example, producer, reply_queue
from tests.worker.helpers import (
    PYTHON,
    REPO,
    Stack,
    WorkerProc,
    _die_with_parent,
    assert_each_request_once,
    jsonl,
    make_values,
    openai_lines,
    wait_for,
)
from tests.worker.services import AMQP_URL, PG_DB, PG_HOST, PG_PORT, free_port, service_down

MODEL = "tiny-chat"  # the name the workers serve the tiny checkpoint under; the catalog declares it
TIME_SCALE = 0.01  # the manifests' seconds, a hundred times faster: cooldown 300 s -> 3 s
WAKE_SECONDS = 30.0  # submission to the first worker started
JOB_SECONDS = 180.0  # submission to the job completed (generous: two shared cores)


@dataclass
class Deployment:
    stack: Stack
    api_url: str
    api_key: str
    prometheus: Prometheus
    client: Client
    workdir: Path

    def demand(self) -> float | None:
        return self.prometheus.query(f'max(conveyor_demand{{model="{MODEL}"}})')


@contextlib.contextmanager
def _schema(admin_user: str) -> Iterator[str]:
    import psycopg

    schema = f"conveyor_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(host=PG_HOST, port=PG_PORT, user=admin_user, dbname=PG_DB, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"postgresql://{admin_user}@{PG_HOST}:{PG_PORT}/{PG_DB}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(host=PG_HOST, port=PG_PORT, user=admin_user, dbname=PG_DB, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _check_rabbitmq() -> None:
    from kombu import Connection

    try:
        with Connection(AMQP_URL, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        service_down(f"RabbitMQ at {AMQP_URL}", repr(exc))


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}: {log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{url} not up after {timeout} s: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, pg_admin_user, tiny_models) -> Iterator[Deployment]:
    binary = prometheus_binary()
    if binary is None:
        service_down("Prometheus (the `prometheus` binary; `apt-get install prometheus`)", "not on PATH")
    _check_rabbitmq()
    workdir = tmp_path_factory.mktemp("autoscaling")
    trigger = scaled_object_trigger(TIME_SCALE)
    with _schema(pg_admin_user) as db_url:
        upgrade_database(db_url)
        values = make_values(
            workdir / "home", tiny_models("llama", max_position_embeddings=4096), database_url=db_url,
            broker_url=AMQP_URL,
            storage_url=(workdir / "objects").as_uri(), served_model_name=MODEL, models=[MODEL],
            worker_concurrency=trigger.concurrency, metrics_cache_seconds=0.25, worker_live_seconds=5.0,
            engine_args={"num_kv_blocks": 4096, "max_num_seqs": 64},  # a burst job's 16 lines of 3,600 tokens
        )  # fmt: skip
        stack = Stack(values, MODEL)
        db = create_db_engine(db_url)
        key = create_key(db, "autoscaling")[1]
        db.dispose()
        port = free_port()
        api_log = workdir / "api.log"
        with open(api_log, "wb") as log:
            api = subprocess.Popen(
                [PYTHON, "-m", "conveyor.worker.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--no-access-log"],
                cwd=REPO, env=stack.env(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
            )  # fmt: skip
        prometheus = Prometheus(binary, workdir / "prometheus", [f"127.0.0.1:{port}"], free_port())
        client = Client(stack.settings)
        try:
            _wait_http(f"http://127.0.0.1:{port}/healthz", api, api_log)
            prometheus.wait_ready()
            found = Deployment(stack, f"http://127.0.0.1:{port}", key, prometheus, client, workdir)
            # The declared model is reported before any work came: the trigger reads 0, not nothing.
            wait_for(lambda: found.demand() == 0, 30, "Prometheus to scrape the API's demand")
            yield found
        finally:
            api.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                api.wait(30)
            if api.poll() is None:
                api.kill()
            prometheus.stop()
            client.close()
            _delete_queues(stack.settings.queue_prefix)


def _delete_queues(prefix: str) -> None:
    from kombu import Connection

    with Connection(AMQP_URL, connect_timeout=3) as conn:
        for name in (queue_name(MODEL, prefix), intake_queue_name(prefix), submit_queue_name(prefix)):
            with contextlib.suppress(Exception):
                channel = conn.channel()
                channel.queue_delete(name)
                channel.exchange_delete(name)


@pytest.fixture
def autoscaler(deployment: Deployment, tmp_path) -> Iterator[Callable[[bool], Autoscaler]]:
    scalers: list[Autoscaler] = []

    def start(jobs: bool = False) -> Autoscaler:
        trigger = scaled_job_trigger(TIME_SCALE) if jobs else scaled_object_trigger(TIME_SCALE)
        count = [0]

        def spawn(args: tuple[str, ...]) -> WorkerProc:
            count[0] += 1
            log = tmp_path / f"{'job' if jobs else 'pod'}-{count[0]}.log"
            return WorkerProc(deployment.stack.env(), log, concurrency=trigger.concurrency, extra_args=args)

        scaler = Autoscaler(deployment.prometheus, trigger, MODEL, spawn, jobs=jobs).start()
        scalers.append(scaler)
        return scaler

    yield start
    for scaler in scalers:
        scaler.stop()


# ---- checks ---------------------------------------------------------------------------------


def at_zero(d: Deployment, scaler: Autoscaler) -> None:
    """No worker runs and Prometheus reads no demand: what the next door starts from."""
    wait_for(lambda: not scaler.live(), 60, "every worker to be gone")
    wait_for(lambda: d.demand() == 0, 30, "the demand to read 0")


HANDED_BACK = "sent back to the queue for another worker"


def log_times(pod: Pod, text: str) -> list[float]:
    """When the worker logged lines holding ``text`` (its log's local timestamps), as time.time()."""
    out = []
    for line in pod.proc.log().splitlines():
        if text in line and line.startswith("[") and "," in line:
            stamp, _, millis = line[1:24].partition(",")
            out.append(time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000)
    return out


def check_stopped_cleanly(scaler: Autoscaler) -> None:
    """Every worker exited 0 and none was killed at the end of its grace period; one that was
    told to stop handed back what it held within its drain time. (Its interpreter's exit after
    that is a fixed cost no time scale shrinks, which the grace period's margin is for: with
    the manifests' 300 s drain the worker keeps 10 s of its own for it.)"""
    drain = scaler.trigger.drain_s
    for pod in scaler.pods:
        assert not pod.alive, pod
        assert pod.returncode == 0 and not pod.killed, f"worker exited {pod.returncode}:\n{pod.proc.log()[-3000:]}"
        if pod.terminated_at is not None:
            handed_back = [t - pod.terminated_at for t in log_times(pod, HANDED_BACK)]
            assert all(t <= drain for t in handed_back), f"handed back {handed_back} s after SIGTERM (drain {drain} s)"


def wait_job(d: Deployment, job_id: str) -> float:
    """When the job was seen completed (time.time())."""
    status = wait_for(
        lambda: (s := d.client.status(job_id)["status"]) in ("completed", "failed", "expired", "cancelled") and s,
        JOB_SECONDS,
        f"job {job_id} to end",
        poll=0.2,
    )
    assert status == "completed", d.client.status(job_id)
    return time.time()


TIMINGS: dict[str, dict[str, float]] = {}


def record(door: str, submitted: float, scaler: Autoscaler, completed: float) -> None:
    pod = scaler.first_started_after(submitted - 0.001)
    assert pod is not None, f"{door}: no worker was started"
    woke = pod.started_at - submitted
    assert woke <= WAKE_SECONDS, f"{door}: the first worker started {woke:.1f} s after the submission"
    ready = (pod.ready_at or math.nan) - submitted
    TIMINGS[door] = {"worker_started_s": woke, "worker_ready_s": ready, "completed_s": completed - submitted}
    print(f"\n{door}: first worker started {woke:.1f} s, ready {ready:.1f} s, job completed "
          f"{completed - submitted:.1f} s after the submission")  # fmt: skip
    out = os.environ.get("CONVEYOR_AUTOSCALING_TIMINGS")
    if out:
        Path(out).write_text(json.dumps(TIMINGS, indent=2))


def lines(n: int, prefix: str = "req", **kw: Any) -> list[dict[str, Any]]:
    rows = openai_lines(n, prefix=prefix, **kw)
    for row in rows:
        row["body"]["model"] = MODEL
    return rows


# ---- the doors ------------------------------------------------------------------------------


def test_every_door_wakes_a_worker_from_zero(deployment: Deployment, autoscaler) -> None:
    d = deployment
    scaler = autoscaler()
    n = 6  # two shards of 4

    # 1. The official openai SDK: upload, create; the API records the batch validating.
    at_zero(d, scaler)
    sdk = openai.OpenAI(base_url=f"{d.api_url}/v1", api_key=d.api_key, max_retries=0, timeout=60)
    upload = sdk.files.create(file=("door1.jsonl", jsonl(lines(n))), purpose="batch")
    t0 = time.time()
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "validating"
    done = wait_job(d, batch.id)
    record("openai SDK batch", t0, scaler, done)
    assert_each_request_once(d.client, d.client.db, d.client.status(batch.id), n)
    assert sdk.batches.retrieve(batch.id).output_file_id is not None

    # 2. A plain kombu producer's message, sent twice: one job, one announcement.
    at_zero(d, scaler)
    example = load_example()
    d.client.store.put_bytes("inputs/door2.jsonl", jsonl(lines(n)))
    key = f"door2-{uuid.uuid4().hex[:8]}"
    with producer(d.stack) as conn, reply_queue(conn) as replies:
        fields = {"input_uri": d.client.store.uri("inputs/door2.jsonl"), "model": MODEL, "idempotency_key": key,
                  "reply_to": replies}  # fmt: skip
        t0 = time.time()
        example.submit(conn, fields, d.stack.settings.queue_prefix)
        example.submit(conn, fields, d.stack.settings.queue_prefix)
        end = example.wait_for_end(conn, replies, key, timeout=JOB_SECONDS)
        done = time.time()
        assert end["status"] == "completed", end
        assert drain(conn, replies, 2.0) == []  # one announcement
    record("kombu message sent twice", t0, scaler, done)
    with d.client.db.connect() as c:
        [created_at] = c.execute(select(Job.created_at).where(Job.idempotency_key == key)).scalars().all()  # one job
    woken = scaler.first_started_after(t0)
    assert woken is not None and created_at < woken.started_at  # the API server took the message, not a worker
    assert_each_request_once(d.client, d.client.db, d.client.status(end["job_id"]), n)

    # 3. conveyor submit: ingested by the submitting process, shards queued before any worker.
    at_zero(d, scaler)
    path = d.workdir / "door3.jsonl"
    path.write_bytes(jsonl(lines(n)))
    t0 = time.time()
    submitted = subprocess.run(
        [PYTHON, "-m", "conveyor.worker.entrypoints.cli", "submit", str(path), "--model", MODEL],
        cwd=REPO, env=d.stack.env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    assert "warning" not in submitted.stderr  # a declared model: an autoscaler starts its worker
    job_id = submitted.stdout.strip()
    done = wait_job(d, job_id)
    record("conveyor submit", t0, scaler, done)
    assert_each_request_once(d.client, d.client.db, d.client.status(job_id), n)

    at_zero(d, scaler)
    check_stopped_cleanly(scaler)
    assert len(scaler.pods) == 3 and all(p.terminated_at is not None for p in scaler.pods)  # one per door
    assert all(" torch threads (" in p.proc.log() for p in scaler.pods)  # each logged its CPU threads at start
    assert not scaler.errors, scaler.errors


# ---- a burst ----------------------------------------------------------------------------------

# The two jobs' outputs per line: each runs well past a worker's cold start, and the second
# runs about twice as long, so the newer worker still runs it when it is scaled in (with 2,000
# tokens it once finished within the 2 s before its shards were due back).
BURST_TOKENS = (1800, 3600)


def in_flight(d: Deployment, job_id: str) -> int:
    with d.client.db.connect() as c:
        return int(
            c.execute(
                select(func.count())
                .select_from(Shard)
                .where(Shard.job_id == job_id, Shard.status == ShardStatus.running)
            ).scalar_one()
        )


def most_at_once(pods: list[Pod]) -> int:
    events = sorted([(p.started_at, 1) for p in pods] + [(p.exited_at or math.inf, -1) for p in pods])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_a_burst_scales_to_two_workers_and_back_handing_back_what_the_scaled_in_one_held(
    deployment: Deployment, autoscaler
) -> None:
    d = deployment
    scaler = autoscaler()
    at_zero(d, scaler)
    per_worker = scaler.trigger.concurrency  # shards a worker runs at once (= the threshold)
    n = per_worker * d.stack.settings.shard_size  # one worker's worth of shards per job

    def submit(name: str, tokens: int) -> str:
        path = d.workdir / f"{name}.jsonl"
        path.write_bytes(jsonl(lines(n, max_tokens=tokens, ignore_eos=True)))
        return str(d.client.submit(str(path), MODEL)["id"])

    first = submit("burst-1", BURST_TOKENS[0])
    wait_for(lambda: in_flight(d, first) == per_worker, 60, "the first job's shards running on one worker")
    assert len(scaler.live()) == 1
    # Demand doubles: a second worker starts, and takes the second job (the first one is full).
    second = submit("burst-2", BURST_TOKENS[1])
    wait_for(lambda: len(scaler.live()) == 2, WAKE_SECONDS, "a second worker")
    done = {job_id: wait_job(d, job_id) for job_id in (first, second)}
    at_zero(d, scaler)

    check_stopped_cleanly(scaler)
    assert len(scaler.pods) == 2 and most_at_once(scaler.pods) == 2
    older, newer = scaler.pods
    # The first job ended, demand fell to one worker's worth: after the stabilization window the
    # newer worker was scaled in, still running the second job's shards, and handed them back.
    assert newer.terminated_at is not None and newer.terminated_at < done[second]
    assert log_times(newer, HANDED_BACK), newer.proc.log()[-3000:]
    assert older.terminated_at is not None and older.terminated_at > max(done.values())  # then to zero
    for job_id in (first, second):
        assert_each_request_once(d.client, d.client.db, d.client.status(job_id), n)
    assert not scaler.errors, scaler.errors


# ---- the ScaledJob mode ---------------------------------------------------------------------


def test_run_to_completion_workers_from_zero_and_back(deployment: Deployment, autoscaler) -> None:
    d = deployment
    scaler = autoscaler(jobs=True)
    at_zero(d, scaler)
    path = d.workdir / "jobs.jsonl"
    path.write_bytes(jsonl(lines(5)))
    t0 = time.time()
    job = d.client.submit(str(path), MODEL)
    done = wait_job(d, job["id"])
    record("ScaledJob: conveyor submit", t0, scaler, done)
    assert_each_request_once(d.client, d.client.db, d.client.status(job["id"]), 5)
    at_zero(d, scaler)  # the worker exits by itself once idle: nobody stops it
    check_stopped_cleanly(scaler)
    assert scaler.pods and all(p.terminated_at is None for p in scaler.pods), "a ScaledJob never stops a worker"
    assert all("--exit-when-idle" in p.args for p in scaler.pods)
    assert not scaler.errors, scaler.errors
