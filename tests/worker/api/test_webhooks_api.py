"""An API key's own webhook endpoints through the official ``openai`` SDK
(``client.webhooks``, which calls ``/v1/webhook_endpoints``; ``/v1/webhooks`` is the same),
delivered by the API server's dispatcher to a local HTTPS receiver: the secret is shown once,
each key sees and receives only its own, bad destinations are refused with a 400 naming why,
a rotated secret keeps the old one signing for the grace period, and ``/metrics`` counts the
deliveries."""

from __future__ import annotations

import time

import httpx2 as httpx
import openai
import pytest
from sqlalchemy import select

from conveyor.worker.core.webhook_signing import new_secret
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import WebhookDelivery, WorkerState
from conveyor.worker.store.workers import register_worker, set_worker_state
from tests.worker.api_batches import MODEL, batch_lines, wait_batch
from tests.worker.api_server import upload
from tests.worker.helpers import scrape
from tests.worker.webhook_receiver import Receiver, unwrap_batch_event

ALL = ["batch.completed", "batch.failed", "batch.cancelled", "batch.expired"]


def _cancelled_batch(client: openai.OpenAI) -> str:
    """A batch created and cancelled before any worker took it up: it ends ``cancelled``."""
    batch = client.batches.create(
        input_file_id=upload(client, batch_lines(2)), endpoint="/v1/chat/completions", completion_window="24h"
    )
    client.batches.cancel(batch.id)
    assert wait_batch(client, batch.id, timeout=30).status == "cancelled"
    return batch.id


@pytest.fixture
def api(embedded_stack, serve, receiver: Receiver):
    stack = embedded_stack.with_values(
        webhook_allow_loopback=True, webhook_ca_bundle=str(receiver.cert), webhook_poll_seconds=0.2,
        webhook_max_endpoints_per_key=2, metrics_cache_seconds=0,
    )  # fmt: skip
    server = serve(stack)
    db = create_db_engine(stack.settings.database)
    set_worker_state(db, register_worker(db, MODEL, "q", checkpoint=stack.model), WorkerState.ready)
    yield server, db
    db.dispose()


def test_each_key_registers_sees_and_receives_only_its_own(api, receiver: Receiver) -> None:
    server, db = api
    alice, bob = server.client(server.new_key("alice")), server.client(server.new_key("bob"))
    a = alice.webhooks.create(url=receiver.url("/alice"), event_types=ALL, name="alice's")
    b = bob.webhooks.create(url=receiver.url("/bob"), event_types=ALL, name="bob's")
    assert a.signing_secret.startswith("whsec_") and a.signing_secret != b.signing_secret
    shown = alice.webhooks.retrieve(a.id)
    assert shown.url == receiver.url("/alice") and shown.event_types == ALL and shown.name == "alice's"
    assert (
        "signing_secret" not in shown.model_dump() and shown.signing_secret_hint == f"whsec_...{a.signing_secret[-4:]}"
    )
    assert [e.id for e in alice.webhooks.list()] == [a.id] and [e.id for e in bob.webhooks.list()] == [b.id]
    with pytest.raises(openai.NotFoundError):
        bob.webhooks.retrieve(a.id)
    with pytest.raises(openai.NotFoundError):
        bob.webhooks.delete(a.id)

    batch_id = _cancelled_batch(alice)
    (delivery,) = receiver.wait_for("/alice")
    event = unwrap_batch_event(delivery, a.signing_secret)
    assert (event.type, event.data.id) == ("batch.cancelled", batch_id)
    with pytest.raises(openai.InvalidWebhookSignatureError):  # bob's secret does not sign alice's events
        alice.webhooks.verify_signature(delivery.body, delivery.headers, secret=b.signing_secret)
    bobs = _cancelled_batch(bob)
    (for_bob,) = receiver.wait_for("/bob")
    assert unwrap_batch_event(for_bob, b.signing_secret).data.id == bobs
    time.sleep(1.0)  # several dispatcher passes: nothing more comes
    assert len(receiver.at("/alice")) == 1 and len(receiver.at("/bob")) == 1
    with db.connect() as conn:  # one delivery each: neither event was fanned out to the other key
        rows = conn.execute(select(WebhookDelivery.endpoint_id)).scalars().all()
    assert sorted(rows) == sorted([a.id, b.id])

    metrics = scrape(server.port)
    assert metrics.value("conveyor_webhook_deliveries", status="delivered") == 2
    assert metrics.value("conveyor_webhook_attempts_total", outcome="delivered") == 2


def test_bad_endpoints_are_refused_naming_why(api, receiver: Receiver) -> None:
    server, _ = api
    client = server.client(server.new_key("carol"))
    for url, why in [
        ("https://10.0.0.1/hook", "a private address"),
        ("https://169.254.169.254/latest", "a link-local address"),
        ("https://[::ffff:192.168.0.1]/hook", "a private address"),
        ("http://93.184.216.34/hook", "must be https"),
    ]:
        with pytest.raises(openai.BadRequestError, match=why) as refused:
            client.webhooks.create(url=url, event_types=["batch.completed"], name="x")
        assert refused.value.param == "url" and refused.value.code == "invalid_url"
    with pytest.raises(openai.BadRequestError, match=r"unknown event type 'batch\.nope'"):
        client.webhooks.create(url=receiver.url("/c"), event_types=["batch.nope"], name="x")
    with pytest.raises(openai.BadRequestError, match="event_types"):
        client.webhooks.create(url=receiver.url("/c"), event_types=[], name="x")
    for _ in range(2):
        client.webhooks.create(url=receiver.url("/c"), event_types=["batch.completed"], name="x")
    with pytest.raises(openai.BadRequestError, match="CONVEYOR_WEBHOOK_MAX_ENDPOINTS_PER_KEY=2"):
        client.webhooks.create(url=receiver.url("/c"), event_types=["batch.completed"], name="x")
    assert len(client.webhooks.list().data) == 2


def test_the_issue_path_rotation_and_deletion(api, receiver: Receiver) -> None:
    server, _ = api
    key = server.new_key("dave")
    client = server.client(key)
    made = httpx.post(
        f"{server.url}/v1/webhooks", headers={"Authorization": f"Bearer {key}"},
        json={"url": receiver.url("/dave"), "event_types": ["batch.cancelled"]},
    )  # fmt: skip
    assert made.status_code == 200, made.text
    endpoint = made.json()
    old = endpoint["signing_secret"]
    assert endpoint["object"] == "webhook_endpoint" and [e.id for e in client.webhooks.list()] == [endpoint["id"]]
    assert httpx.get(f"{server.url}/v1/webhooks/{endpoint['id']}").status_code == 401  # no key, no endpoint

    rotated = client.webhooks.rotate_secret(endpoint["id"], keep_old_secret_active_for_24_hours=True)
    assert rotated.signing_secret not in (old, None)
    updated = client.webhooks.update(endpoint["id"], event_types=["batch.cancelled", "batch.completed"])
    assert updated.event_types == ["batch.cancelled", "batch.completed"]
    _cancelled_batch(client)
    (delivery,) = receiver.wait_for("/dave")
    for secret in (old, rotated.signing_secret):  # both sign during the grace period
        client.webhooks.verify_signature(delivery.body, delivery.headers, secret=secret)

    again = client.webhooks.rotate_secret(endpoint["id"])  # the previous one stops at once
    assert client.webhooks.delete(endpoint["id"]).deleted
    assert client.webhooks.list().data == []
    with pytest.raises(openai.NotFoundError):
        client.webhooks.retrieve(endpoint["id"])
    assert again.signing_secret != rotated.signing_secret


def test_a_batch_a_worker_runs_reaches_the_operator_and_its_owner_once(embedded_stack, serve, spawn_worker,
                                                                       receiver: Receiver) -> None:  # fmt: skip
    """Through a worker process: it finalises the batch (the event written there) and, like
    the API server, dispatches; each endpoint gets ``batch.completed`` once."""
    secret = new_secret()
    stack = embedded_stack.with_values(
        webhook_urls=receiver.url("/operator"), webhook_secret=secret, webhook_allow_loopback=True,
        webhook_ca_bundle=str(receiver.cert), webhook_poll_seconds=0.2,
    )  # fmt: skip
    worker = spawn_worker(stack, served_model_name=MODEL)
    server = serve(stack)
    client = server.client(server.new_key("erin"))
    mine = client.webhooks.create(url=receiver.url("/erin"), event_types=["batch.completed"], name="erin")
    worker.wait_ready()
    batch = client.batches.create(
        input_file_id=upload(client, batch_lines(2)), endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert wait_batch(client, batch.id).status == "completed"
    (to_operator,) = receiver.wait_for("/operator")
    (to_owner,) = receiver.wait_for("/erin")
    assert unwrap_batch_event(to_operator, secret).data.id == batch.id
    owner_event = unwrap_batch_event(to_owner, mine.signing_secret)
    assert owner_event.type == "batch.completed" and owner_event.data.id == batch.id
    assert to_operator.headers["webhook-id"] == to_owner.headers["webhook-id"]  # one event, two endpoints
    time.sleep(1.0)
    assert len(receiver.at("/operator")) == len(receiver.at("/erin")) == 1
