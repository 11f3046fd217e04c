"""Webhooks end to end against a local HTTPS receiver (a real TLS server, its self-signed
certificate trusted through ``CONVEYOR_WEBHOOK_CA_BUNDLE``; loopback allowed for the test):
the operator's endpoint (``CONVEYOR_WEBHOOK_URLS``) gets each job's end once, signed so that
the ``openai`` SDK verifies it, after a crash too; failures are retried under the same id;
private and redirecting destinations are refused."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import select, update

from conveyor.worker.core.webhook_signing import new_secret
from conveyor.worker.entrypoints import cli
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.jobs.webhook_dispatch import WebhookDispatcher, attempt, claim_due, fan_out
from conveyor.worker.jobs.webhook_events import EVENT_TYPES
from conveyor.worker.metrics.db_collector import read_counts
from conveyor.worker.store.database import create_db_engine, make_sessionmaker
from conveyor.worker.store.models import WebhookDelivery, WebhookDeliveryStatus, WebhookEvent
from conveyor.worker.store.schema import upgrade_database
from tests.worker.helpers import PYTHON, REPO, jsonl, openai_lines
from tests.worker.webhook_receiver import Receiver, unwrap_batch_event

SECRET = new_secret()


def _stack(embedded_stack, receiver: Receiver, *paths: str, **values: Any):
    return embedded_stack.with_values(
        webhook_urls=",".join(receiver.url(p) if p.startswith("/") else p for p in paths),
        webhook_secret=SECRET, webhook_allow_loopback=True, webhook_ca_bundle=str(receiver.cert), **values,
    )  # fmt: skip


def _cancelled_job(client: Client, model: str) -> str:
    job = client.submit(jsonl(openai_lines(2)), model, enqueue=False)
    assert client.cancel(job["id"])["status"] == "cancelled"
    return job["id"]


def test_every_event_type_fires_once_per_batch_signed_for_the_openai_sdk(embedded_stack, receiver) -> None:
    stack = _stack(embedded_stack, receiver, "/ops", max_lines_per_job=3, min_completion_window_seconds=1)
    client = Client(stack.settings)
    ends: dict[str, str] = {}
    try:
        ends["batch.completed"] = client.submit(b"nope\n", stack.model, enqueue=False)["id"]  # every line invalid
        failed = client.submit(jsonl(openai_lines(5)), stack.model, enqueue=False)  # more lines than allowed
        assert failed["status"] == "failed"
        ends["batch.failed"] = failed["id"]
        ends["batch.cancelled"] = _cancelled_job(client, stack.model)
        expiring = client.submit(jsonl(openai_lines(2)), stack.model, completion_window="1s", enqueue=False)
        time.sleep(max(0.0, expiring["expires_at"] + 0.2 - time.time()))
        assert client.wait(expiring["id"], timeout=10, poll=0.1)["status"] == "expired"
        ends["batch.expired"] = expiring["id"]

        dispatcher = WebhookDispatcher(client.db, stack.settings)
        assert dispatcher.drain(20)
        assert dispatcher.run_once() == 0  # nothing more to send: each event went once
        dispatcher.close()
    finally:
        client.close()

    got = receiver.at("/ops")
    assert len(got) == 4
    seen = {}
    for delivery in got:
        event = unwrap_batch_event(delivery, SECRET)  # raises unless the signature verifies
        assert delivery.headers["webhook-id"] == event.id and event.id.startswith("evt_")
        assert event.object == "event" and abs(event.created_at - time.time()) < 60
        assert delivery.headers["content-type"] == "application/json"
        seen[event.type] = event.data.id
    assert seen == ends and set(seen) == set(EVENT_TYPES)


def test_an_event_committed_before_a_crash_is_delivered_once_after_it(embedded_stack, receiver) -> None:
    """The process that ends the job dies at once (SIGKILL) after the state change commits,
    before any delivery; a process started afterwards delivers the event, once, with the id
    the outbox gave it."""
    stack = _stack(embedded_stack, receiver, "/ops")
    client = Client(stack.settings)
    job = client.submit(jsonl(openai_lines(2)), stack.model, enqueue=False)
    script = (
        "import os, signal, sys\n"
        "from conveyor.worker.core.settings import Settings\n"
        "from conveyor.worker.entrypoints.client import Client\n"
        "Client(Settings()).cancel(sys.argv[1])\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([PYTHON, "-c", script, job["id"]], cwd=REPO, env=stack.env(), timeout=120)
    assert done.returncode == -signal.SIGKILL
    try:
        assert client.status(job["id"])["status"] == "cancelled"
        with client.db.connect() as conn:
            events = conn.execute(
                select(WebhookEvent.id, WebhookEvent.type).where(WebhookEvent.job_id == job["id"])
            ).all()
            assert conn.execute(select(WebhookDelivery.id)).all() == []
        assert [e.type for e in events] == ["batch.cancelled"]
        assert receiver.at("/ops") == []

        dispatcher = WebhookDispatcher(client.db, stack.settings)  # the restart
        assert dispatcher.drain(20)
        dispatcher.close()
    finally:
        client.close()
    (delivery,) = receiver.at("/ops")
    event = unwrap_batch_event(delivery, SECRET)
    assert event.id == events[0].id and event.data.id == job["id"] and event.type == "batch.cancelled"


def test_a_crash_mid_delivery_sends_it_again_with_the_same_id(embedded_stack, receiver) -> None:
    """A sender that posted but died before recording it: once its lease runs out (moved
    here), the delivery goes again under the same ``webhook-id`` (at least once)."""
    stack = _stack(embedded_stack, receiver, "/ops")
    client = Client(stack.settings)
    try:
        job_id = _cancelled_job(client, stack.model)
        dispatcher = WebhookDispatcher(client.db, stack.settings)
        fan_out(client.db, dispatcher.config)
        (claim,) = claim_due(client.db, dispatcher.config)
        assert attempt(client.db, dispatcher.config, claim).delivered  # ... and the process dies here
        assert claim_due(client.db, dispatcher.config) == []  # leased: nobody else sends it meanwhile
        with client.db.begin() as conn:
            conn.execute(update(WebhookDelivery).values(lease_until=time.time() - 1))  # the lease runs out
        assert dispatcher.drain(20)
        dispatcher.close()
        with client.db.connect() as conn:
            row = conn.execute(select(WebhookDelivery.status, WebhookDelivery.attempts)).one()
    finally:
        client.close()
    first, second = receiver.at("/ops")
    assert first.headers["webhook-id"] == second.headers["webhook-id"] and first.body == second.body
    assert json.loads(first.body)["data"]["id"] == job_id
    assert (WebhookDeliveryStatus(row.status), row.attempts) == (WebhookDeliveryStatus.delivered, 2)


def test_a_receiver_that_fails_twice_gets_a_third_delivery_with_the_same_id(embedded_stack, receiver) -> None:
    stack = _stack(embedded_stack, receiver, "/flaky")
    receiver.script["/flaky"] = [500, 503]
    client = Client(stack.settings)
    try:
        job_id = _cancelled_job(client, stack.model)
        dispatcher = WebhookDispatcher(client.db, stack.settings)
        assert dispatcher.drain(20)
        dispatcher.close()
        with make_sessionmaker(client.db)() as session:
            row = session.scalars(select(WebhookDelivery)).one()
    finally:
        client.close()
    tries = receiver.at("/flaky")
    assert len(tries) == 3
    assert len({t.headers["webhook-id"] for t in tries}) == 1 and len({t.body for t in tries}) == 1
    for t in tries:  # each retry is signed afresh, and verifies
        assert unwrap_batch_event(t, SECRET).data.id == job_id
    # Backoff: about 1 s, then about 2 s (+/-10%, and a poll's lateness).
    assert 0.85 <= tries[1].at - tries[0].at < 5 and 1.75 <= tries[2].at - tries[1].at < 8
    assert (row.status, row.attempts, row.last_status_code) == (WebhookDeliveryStatus.delivered, 3, 200)


def test_private_and_redirecting_destinations_are_refused(embedded_stack, receiver, env, capsys) -> None:
    """An operator URL on a private address fails at once, naming why; a receiver that
    redirects (here to a private address) is not followed. Both show in ``conveyor webhooks``
    and in the metrics' delivery counts."""
    receiver.redirects["/moved"] = "https://10.1.2.3/steal"
    unresolved = "https://no-such-host.invalid/hook"  # retried: a DNS outage passes
    stack = _stack(embedded_stack, receiver, "/moved", "https://10.0.0.7/hook", "https://169.254.169.254/x", unresolved)
    client = Client(stack.settings)
    try:
        _cancelled_job(client, stack.model)
        dispatcher = WebhookDispatcher(client.db, stack.settings)
        assert dispatcher.run_once() == 4
        dispatcher.close()
        with make_sessionmaker(client.db)() as session:
            rows = {r.url: r for r in session.scalars(select(WebhookDelivery))}
        counts = read_counts(client.db, live_seconds=60).webhooks
    finally:
        client.close()
    assert len(receiver.at("/moved")) == 1  # asked once; the redirect's target never
    moved = rows[receiver.url("/moved")]
    assert moved.status is WebhookDeliveryStatus.pending and moved.last_status_code == 307
    assert "redirect to 'https://10.1.2.3/steal' refused" in (moved.last_error or "")
    private, metadata = rows["https://10.0.0.7/hook"], rows["https://169.254.169.254/x"]
    assert private.status is WebhookDeliveryStatus.failed and "10.0.0.7, a private address" in str(private.last_error)
    assert metadata.status is WebhookDeliveryStatus.failed and "a link-local address" in str(metadata.last_error)
    assert rows[unresolved].status is WebhookDeliveryStatus.pending
    assert "'no-such-host.invalid' does not resolve" in str(rows[unresolved].last_error)
    assert counts == {"pending": 2, "failed": 2}

    env(stack)
    capsys.readouterr()
    assert cli.main(["webhooks", "--status", "failed"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all("failed" in line and "batch.cancelled" in line for line in out)
    assert any("https://10.0.0.7/hook" in line and "a private address" in line for line in out)
    assert cli.main(["webhooks", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(r["status"] for r in listed) == ["failed", "failed", "pending", "pending"]


def test_conveyor_run_delivers_its_job_end_before_it_exits(embedded_stack, receiver, tmp_path) -> None:
    stack = _stack(embedded_stack, receiver, "/ops")
    (tmp_path / "in.jsonl").write_bytes(jsonl(openai_lines(2)))
    done = subprocess.run(
        [PYTHON, "-m", "conveyor.worker.entrypoints.cli", "run", str(tmp_path / "in.jsonl"), "--model",
         stack.model, "-o", str(tmp_path / "out.jsonl"), "--quiet"],
        cwd=REPO, env=stack.env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (delivery,) = receiver.at("/ops")  # there when the process has exited
    event = unwrap_batch_event(delivery, SECRET)
    assert event.type == "batch.completed"
    db = create_db_engine(stack.settings.database)
    try:
        with db.connect() as conn:
            assert conn.execute(select(WebhookEvent.job_id)).scalar_one() == event.data.id
    finally:
        db.dispose()


def test_nothing_is_sent_without_endpoints(embedded_stack) -> None:
    """No operator URL and an owner-less job: the event is kept (fanned out to nobody)."""
    client = Client(embedded_stack.settings)
    try:
        _cancelled_job(client, embedded_stack.model)
        dispatcher = WebhookDispatcher(client.db, embedded_stack.settings)
        assert dispatcher.drain(5) and dispatcher.run_once() == 0
        dispatcher.close()
        with client.db.connect() as conn:
            assert conn.execute(select(WebhookEvent.fanned_out_at)).scalar_one() is not None
            assert conn.execute(select(WebhookDelivery.id)).all() == []
    finally:
        client.close()


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_two_dispatchers_at_once_deliver_each_event_once(embedded_stack, receiver, request, database: str) -> None:
    """Every process runs a dispatcher: fan-out and claims are shared safely (``SKIP LOCKED``
    and a compare-and-set on the lease on PostgreSQL, the lease alone on SQLite)."""
    values = {}
    if database == "postgres":
        values["database_url"] = request.getfixturevalue("pg_url")
        upgrade_database(values["database_url"])
    stack = _stack(embedded_stack, receiver, "/ops", **values)
    client = Client(stack.settings)
    other_db = create_db_engine(stack.settings.database)
    dispatchers = [WebhookDispatcher(client.db, stack.settings), WebhookDispatcher(other_db, stack.settings)]
    try:
        ids = [_cancelled_job(client, stack.model) for _ in range(6)]
        with ThreadPoolExecutor(2) as pool:
            for _ in range(3):
                list(pool.map(lambda d: d.run_once(), dispatchers))
        assert all(d.drain(20) for d in dispatchers)
    finally:
        for d in dispatchers:
            d.close()
        other_db.dispose()
        client.close()
    delivered = [json.loads(r.body)["data"]["id"] for r in receiver.at("/ops")]
    assert sorted(delivered) == sorted(ids)


def test_a_delivery_still_failing_at_the_maximum_age_is_marked_failed(embedded_stack, receiver) -> None:
    """Retries stop at ``CONVEYOR_WEBHOOK_MAX_AGE_SECONDS`` after the event (24 h by default;
    3 s here): the delivery is ``failed`` with the receiver's last answer."""
    stack = _stack(embedded_stack, receiver, "/down", webhook_max_age_seconds=3)
    receiver.script["/down"] = [500] * 100
    client = Client(stack.settings)
    try:
        _cancelled_job(client, stack.model)
        dispatcher = WebhookDispatcher(client.db, stack.settings)
        assert dispatcher.drain(20)  # nothing left pending: given up
        dispatcher.close()
        with make_sessionmaker(client.db)() as session:
            row = session.scalars(select(WebhookDelivery)).one()
    finally:
        client.close()
    tries = receiver.at("/down")
    assert 2 <= len(tries) <= 3 and len({t.headers["webhook-id"] for t in tries}) == 1  # at about 0, 1 and 3 s
    assert (row.status, row.attempts, row.last_status_code) == (WebhookDeliveryStatus.failed, len(tries), 500)
    assert row.last_error == "HTTP 500: ok"
