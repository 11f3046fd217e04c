"""The webhook outbox's delivering side: fan events out to endpoints, deliver what is due.

Every process that runs jobs or serves the API (``conveyor serve``, ``conveyor worker``,
``conveyor run``) calls ``WebhookDispatcher.run_once`` every ``CONVEYOR_WEBHOOK_POLL_SECONDS``:

1. **Fan-out.** Each event not fanned out yet (``webhook_events.fanned_out_at`` NULL) gets one
   ``webhook_deliveries`` row per endpoint that takes it: every operator URL
   (``CONVEYOR_WEBHOOK_URLS``: all events, whatever door the job came in by) and the endpoints
   of the key that owns the job whose ``event_types`` name it. A key's endpoints see only
   its own jobs' events; a job without an owner reaches the operator's only. Unique on
   (event, endpoint), so two processes fanning out at once make each delivery once.
2. **Claim.** Due deliveries (pending, ``next_attempt_at`` passed, no live lease) are leased
   for the attempt (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, then a compare-and-set on the
   lease, which alone suffices on SQLite), oldest first and at most ``PER_ENDPOINT`` per
   endpoint a pass, so one slow receiver does not hold back the others.
3. **Attempt.** The event's payload (the same bytes every time) is signed afresh (a new
   ``webhook-timestamp``, the same ``webhook-id``: the event's id) and posted
   (``webhook_sender``), a few at a time on a thread pool.
4. **Outcome.** A 2xx marks it ``delivered``. A failure is retried after 1, 2, 4, 8 ... seconds
   (doubling, at most an hour, +/-10% jitter: the first three attempts within a few seconds)
   until ``CONVEYOR_WEBHOOK_MAX_AGE_SECONDS`` (24 h) after the event, then it is ``failed``; a
   refused destination (a private address, say) or a deleted endpoint fails at once.

A process that dies mid-attempt leaves its lease to run out; the delivery is then claimed
again and sent with the same id (at least once: receivers dedupe on ``webhook-id``).
Delivered and failed rows, and their events, are deleted after ``RETENTION_SECONDS``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, exists, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from conveyor.worker.core.settings import Settings
from conveyor.worker.core.webhook_signing import signed_headers
from conveyor.worker.jobs.webhook_endpoints import signing_secrets
from conveyor.worker.jobs.webhook_sender import AttemptResult, post_event
from conveyor.worker.store.models import (
    WebhookDelivery,
    WebhookDeliveryStatus,
    WebhookEndpoint,
    WebhookEvent,
    now,
)

log = logging.getLogger(__name__)

FAN_OUT_BATCH = 64
CLAIM_BATCH = 32
PER_ENDPOINT = 4
SEND_THREADS = 8
MAX_BACKOFF_SECONDS = 3600.0
RETENTION_SECONDS = 30 * 86_400.0
PRUNE_EVERY_SECONDS = 3600.0
OPERATOR_PREFIX = "operator-"
MAX_LISTED = 1000

PENDING, DELIVERED, FAILED = (
    WebhookDeliveryStatus.pending,
    WebhookDeliveryStatus.delivered,
    WebhookDeliveryStatus.failed,
)


def operator_endpoint_id(url: str) -> str:
    """The endpoint id of an operator URL: stable across processes and restarts."""
    return OPERATOR_PREFIX + hashlib.sha256(url.encode()).hexdigest()[:24]


def backoff_seconds(attempts: int, rng: Callable[[], float] = random.random) -> float:
    """The wait after the ``attempts``-th failed attempt: 1, 2, 4 ... s, at most an hour, +/-10%."""
    base = min(MAX_BACKOFF_SECONDS, 2.0 ** max(0, attempts - 1))
    return base * (0.9 + 0.2 * rng())


@dataclass(frozen=True)
class WebhookConfig:
    operator_urls: tuple[str, ...]
    operator_secret: str | None
    allow_loopback: bool
    timeout: float
    max_age: float
    ca_bundle: Path | None

    @classmethod
    def of(cls, settings: Settings) -> WebhookConfig:
        return cls(
            settings.webhook_urls, settings.webhook_secret, settings.webhook_allow_loopback,
            settings.webhook_timeout_seconds, settings.webhook_max_age_seconds, settings.webhook_ca_bundle,
        )  # fmt: skip

    @property
    def lease_seconds(self) -> float:
        """Longer than any attempt can take (connect, then a reply within twice the timeout)."""
        return 4 * self.timeout + 30.0


@dataclass(frozen=True)
class Claimed:
    delivery_id: int
    event_id: str
    endpoint_id: str
    url: str
    attempts: int  # this attempt's number
    lease_until: float
    payload: dict[str, Any]
    event_created_at: float


def _insert_ignoring_duplicates(conn: Connection, rows: list[dict[str, Any]]) -> None:
    if rows:
        dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
        conn.execute(dialect.insert(WebhookDelivery).on_conflict_do_nothing(), rows)


def fan_out(db: Engine, config: WebhookConfig, *, limit: int = FAN_OUT_BATCH) -> int:
    """Make the deliveries of up to ``limit`` events not fanned out yet; the events done."""
    t = now()
    with db.begin() as conn:
        events = conn.execute(
            select(WebhookEvent.id, WebhookEvent.type, WebhookEvent.owner)
            .where(WebhookEvent.fanned_out_at.is_(None))
            .order_by(WebhookEvent.created_at)
            .limit(limit)
        ).all()
        if not events:
            return 0
        owners = {e.owner for e in events if e.owner is not None}
        by_owner: dict[str, list[Any]] = {}
        if owners:
            for ep in conn.execute(
                select(
                    WebhookEndpoint.id, WebhookEndpoint.owner, WebhookEndpoint.url, WebhookEndpoint.event_types
                ).where(WebhookEndpoint.owner.in_(owners))
            ):
                by_owner.setdefault(ep.owner, []).append(ep)
        rows = []
        common = {"status": PENDING, "attempts": 0, "next_attempt_at": t, "created_at": t, "updated_at": t}
        for event in events:
            for url in config.operator_urls:
                rows.append({**common, "event_id": event.id, "endpoint_id": operator_endpoint_id(url),
                             "owner": None, "url": url})  # fmt: skip
            for ep in by_owner.get(event.owner, []) if event.owner is not None else []:
                if event.type in ep.event_types:
                    rows.append({**common, "event_id": event.id, "endpoint_id": ep.id, "owner": ep.owner,
                                 "url": ep.url})  # fmt: skip
        _insert_ignoring_duplicates(conn, rows)
        conn.execute(
            update(WebhookEvent)
            .where(WebhookEvent.id.in_([e.id for e in events]), WebhookEvent.fanned_out_at.is_(None))
            .values(fanned_out_at=t)
        )
    return len(events)


def _free(t: float):
    return or_(WebhookDelivery.lease_until.is_(None), WebhookDelivery.lease_until < t)


def claim_due(db: Engine, config: WebhookConfig, *, limit: int = CLAIM_BATCH) -> list[Claimed]:
    """Lease up to ``limit`` due deliveries (at most ``PER_ENDPOINT`` per endpoint)."""
    t = now()
    lease_until = t + config.lease_seconds
    claimed: list[Claimed] = []
    with db.begin() as conn:
        stmt = (
            select(WebhookDelivery.id, WebhookDelivery.endpoint_id)
            .where(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= t, _free(t))
            .order_by(WebhookDelivery.next_attempt_at)
            .limit(limit * PER_ENDPOINT)
        )
        if conn.dialect.name == "postgresql":
            stmt = stmt.with_for_update(skip_locked=True)
        per_endpoint: dict[str, int] = {}
        chosen: list[int] = []
        for row in conn.execute(stmt):
            if len(chosen) >= limit or per_endpoint.get(row.endpoint_id, 0) >= PER_ENDPOINT:
                continue
            per_endpoint[row.endpoint_id] = per_endpoint.get(row.endpoint_id, 0) + 1
            chosen.append(row.id)
        for delivery_id in chosen:
            won = conn.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == PENDING, _free(t))
                .values(lease_until=lease_until, attempts=WebhookDelivery.attempts + 1, updated_at=t)
            ).rowcount
            if not won:
                continue
            row = conn.execute(
                select(
                    WebhookDelivery.event_id, WebhookDelivery.endpoint_id, WebhookDelivery.url,
                    WebhookDelivery.attempts, WebhookEvent.payload, WebhookEvent.created_at,
                )
                .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
                .where(WebhookDelivery.id == delivery_id)
            ).one()  # fmt: skip
            claimed.append(
                Claimed(
                    delivery_id,
                    row.event_id,
                    row.endpoint_id,
                    row.url,
                    row.attempts,
                    lease_until,
                    dict(row.payload),
                    row.created_at,
                )
            )
    return claimed


def event_body(payload: dict[str, Any]) -> bytes:
    """The bytes every delivery of an event sends (and signs)."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def _secrets_of(db: Engine, config: WebhookConfig, claim: Claimed, t: float) -> tuple[str, list[str]] | str:
    """The URL and secrets to deliver ``claim`` with, or why it cannot be."""
    if claim.endpoint_id.startswith(OPERATOR_PREFIX):
        if not config.operator_secret:
            return "no CONVEYOR_WEBHOOK_SECRET to sign the operator's webhooks with"
        return claim.url, [config.operator_secret]
    with db.connect() as conn:
        row = conn.execute(select(WebhookEndpoint).where(WebhookEndpoint.id == claim.endpoint_id)).one_or_none()
    if row is None:
        return "the webhook endpoint was deleted"
    endpoint = WebhookEndpoint(**row._mapping)
    return endpoint.url, signing_secrets(endpoint, t)


def attempt(db: Engine, config: WebhookConfig, claim: Claimed) -> AttemptResult:
    """Send ``claim`` once, signed now."""
    t = now()
    target = _secrets_of(db, config, claim, t)
    if isinstance(target, str):
        return AttemptResult(False, error=target, permanent=True)
    url, secrets = target
    body = event_body(claim.payload)
    headers = signed_headers(secrets, claim.event_id, int(t), body)
    return post_event(
        url, body, headers, allow_loopback=config.allow_loopback, timeout=config.timeout, ca_bundle=config.ca_bundle
    )


def record_outcome(db: Engine, config: WebhookConfig, claim: Claimed, result: AttemptResult) -> WebhookDeliveryStatus:
    """Store what the attempt came to (only while this claim still holds the lease)."""
    t = now()
    values: dict[str, Any] = {"lease_until": None, "updated_at": t, "last_status_code": result.status_code}
    if result.delivered:
        status = DELIVERED
        values.update(status=DELIVERED, last_error=None)
    else:
        retry_at = t + backoff_seconds(claim.attempts)
        too_old = retry_at > claim.event_created_at + config.max_age
        status = FAILED if result.permanent or too_old else PENDING
        values.update(status=status, last_error=result.error, next_attempt_at=retry_at)
    with db.begin() as conn:
        conn.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == claim.delivery_id, WebhookDelivery.lease_until == claim.lease_until)
            .values(**values)
        )
    if status is FAILED:
        log.warning(
            "webhook %s to %s failed for good after %d attempts: %s",
            claim.event_id, claim.endpoint_id, claim.attempts, result.error,
        )  # fmt: skip
    return status


def prune(db: Engine, *, older_than: float) -> int:
    """Delete finished deliveries last touched before ``older_than``, and events left with none
    pending; the number of events deleted."""
    with db.begin() as conn:
        conn.execute(
            delete(WebhookDelivery).where(
                WebhookDelivery.status.in_((DELIVERED, FAILED)), WebhookDelivery.updated_at < older_than
            )
        )
        pending = exists().where(WebhookDelivery.event_id == WebhookEvent.id)
        return conn.execute(
            delete(WebhookEvent).where(
                WebhookEvent.created_at < older_than, WebhookEvent.fanned_out_at.is_not(None), ~pending
            )
        ).rowcount


def next_due(db: Engine) -> float | None:
    """When something is next to do: now for an event not fanned out, else the earliest
    pending delivery's next attempt (or its lease's end); None when nothing is pending."""
    with db.connect() as conn:
        if conn.execute(select(exists().where(WebhookEvent.fanned_out_at.is_(None)))).scalar():
            return now()
        when = conn.execute(
            select(func.min(func.coalesce(WebhookDelivery.lease_until, WebhookDelivery.next_attempt_at))).where(
                WebhookDelivery.status == PENDING
            )
        ).scalar()
    return None if when is None else float(when)


class WebhookDispatcher:
    """Fan-out and delivery passes for one process (``run_once`` from a ``Periodic``).
    ``on_attempt(outcome)`` counts each attempt: ``delivered``, ``retrying`` or ``failed``."""

    def __init__(self, db: Engine, settings: Settings, *, on_attempt: Callable[[str], None] | None = None) -> None:
        self.db, self.config = db, WebhookConfig.of(settings)
        self._on_attempt = on_attempt
        self._pool = ThreadPoolExecutor(SEND_THREADS, thread_name_prefix="conveyor-webhook")
        self._pruned_at = 0.0

    def run_once(self) -> int:
        """One pass: fan out, then attempt what is due; the number of attempts made."""
        while fan_out(self.db, self.config) == FAN_OUT_BATCH:
            pass
        claims = claim_due(self.db, self.config)
        for status in self._pool.map(self._deliver, claims):
            if self._on_attempt is not None:
                self._on_attempt("retrying" if status is PENDING else status.value)
        if time.monotonic() - self._pruned_at > PRUNE_EVERY_SECONDS:
            self._pruned_at = time.monotonic()
            prune(self.db, older_than=now() - RETENTION_SECONDS)
        return len(claims)

    def _deliver(self, claim: Claimed) -> WebhookDeliveryStatus:
        try:
            result = attempt(self.db, self.config, claim)
        except Exception as exc:  # a bug or the database: retried like a failed attempt
            log.warning("webhook %s: the attempt failed: %r", claim.event_id, exc)
            result = AttemptResult(False, error=f"{type(exc).__name__} while sending")
        return record_outcome(self.db, self.config, claim, result)

    def drain(self, seconds: float, *, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Passes until nothing is pending or ``seconds`` have passed (a short-lived process,
        ``conveyor run``, before it exits); True when nothing is left pending."""
        deadline = time.monotonic() + seconds
        while True:
            self.run_once()
            due = next_due(self.db)
            if due is None:
                return True
            left = deadline - time.monotonic()
            wait = max(0.05, due - now())
            if wait >= left:
                return False
            sleep(wait)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def recent_deliveries(
    db: Engine, *, statuses: Iterable[WebhookDeliveryStatus] = (), limit: int = 50
) -> list[dict[str, Any]]:
    """The latest deliveries (newest first) with their event, for ``conveyor webhooks``."""
    if not 1 <= limit <= MAX_LISTED:
        raise ValueError(f"limit must be from 1 to {MAX_LISTED}")
    stmt = (
        select(
            WebhookDelivery.id, WebhookDelivery.event_id, WebhookEvent.type, WebhookEvent.job_id,
            WebhookDelivery.endpoint_id, WebhookDelivery.owner, WebhookDelivery.url, WebhookDelivery.status,
            WebhookDelivery.attempts, WebhookDelivery.next_attempt_at, WebhookDelivery.last_status_code,
            WebhookDelivery.last_error, WebhookDelivery.created_at, WebhookDelivery.updated_at,
        )
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .order_by(WebhookDelivery.updated_at.desc(), WebhookDelivery.id.desc())
        .limit(limit)
    )  # fmt: skip
    wanted = list(statuses)
    if wanted:
        stmt = stmt.where(WebhookDelivery.status.in_(wanted))
    with db.connect() as conn:
        rows = conn.execute(stmt).all()
    return [{**row._asdict(), "status": WebhookDeliveryStatus(row.status).value} for row in rows]
