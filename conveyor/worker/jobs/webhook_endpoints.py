"""The webhook endpoints an API key registers for its own batches (``/v1/webhooks``).

An endpoint is OpenAI's ``webhook_endpoint`` object: ``id`` (``we_<hex>``), ``url``,
``event_types`` (of ``batch.completed``, ``batch.failed``, ``batch.cancelled``,
``batch.expired``), ``name``, ``created_at``, ``updated_at`` and ``signing_secret_hint``. Its
signing secret (``whsec_...``) is shown once, in the answer that creates or rotates it. A
rotation may keep the previous secret signing beside the new one for 24 hours. The URL is
checked where it resolves when registered and again at every delivery. A key sees, changes
and deletes only its own endpoints (another's are "not found"), and has at most
``CONVEYOR_WEBHOOK_MAX_ENDPOINTS_PER_KEY``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.engine import Engine

from conveyor.worker.core.storable_text import check_storable
from conveyor.worker.core.webhook_destination import check_destination
from conveyor.worker.core.webhook_signing import new_secret, secret_hint
from conveyor.worker.jobs.webhook_events import EVENT_TYPES
from conveyor.worker.store.database import make_sessionmaker
from conveyor.worker.store.models import WebhookEndpoint, now
from conveyor.worker.store.owner_turns import take_owner_turn

MAX_NAME_CHARS = 128
MAX_LIST_LIMIT = 100
ROTATION_GRACE_SECONDS = 86_400.0
ID_PREFIX = "we_"
ENDPOINT_ID = re.compile(r"we_[0-9a-f]{32}")


class EndpointNotFound(LookupError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no such webhook endpoint"


class TooManyEndpoints(ValueError):
    """The key has its maximum number of endpoints."""


def endpoint_object(row: WebhookEndpoint, *, secret: str | None = None) -> dict[str, Any]:
    """OpenAI's ``webhook_endpoint`` (with ``signing_secret`` only when given)."""
    obj: dict[str, Any] = {
        "id": row.id,
        "object": "webhook_endpoint",
        "created_at": int(row.created_at),
        "updated_at": int(row.updated_at),
        "event_types": list(row.event_types),
        "name": row.name,
        "url": row.url,
        "signing_secret_hint": secret_hint(row.secret),
    }
    if secret is not None:
        obj["signing_secret"] = secret
    return obj


def check_event_types(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"event_types must be a non-empty list of {', '.join(EVENT_TYPES)}")
    unknown = [v for v in value if v not in EVENT_TYPES]
    if unknown:
        raise ValueError(f"unknown event type {str(unknown[0])[:64]!r}: Conveyor sends {', '.join(EVENT_TYPES)}")
    return list(dict.fromkeys(value))


def check_name(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        raise ValueError(f"name must be a string of at most {MAX_NAME_CHARS} characters")
    check_storable(value, "name")
    return value


def check_url(url: str, *, allow_loopback: bool) -> None:
    """``url`` storable, and where it resolves to allowed (``DestinationRefused`` otherwise)."""
    check_storable(url, "url")
    check_destination(url, allow_loopback=allow_loopback)


def create_endpoint(
    db: Engine,
    owner: str | None,
    *,
    url: str,
    event_types: Sequence[str],
    name: str = "",
    allow_loopback: bool = False,
    max_per_key: int = 10,
) -> dict[str, Any]:
    """Register ``url`` for ``owner``'s batch events; the object with its ``signing_secret``."""
    if owner is None:
        raise ValueError("webhook endpoints belong to an API key; a server without keys has the operator's only")
    types, name = check_event_types(list(event_types)), check_name(name)
    check_url(url, allow_loopback=allow_loopback)
    secret, t = new_secret(), now()
    row = WebhookEndpoint(
        id=f"{ID_PREFIX}{uuid.uuid4().hex}", owner=owner, name=name, url=url, event_types=types, secret=secret,
        created_at=t, updated_at=t,
    )  # fmt: skip
    with make_sessionmaker(db).begin() as session:
        take_owner_turn(session.connection(), owner)
        count = session.scalar(select(func.count()).where(WebhookEndpoint.owner == owner)) or 0
        if count >= max_per_key:
            raise TooManyEndpoints(
                f"this key has {count} webhook endpoints, the most it may have "
                f"(CONVEYOR_WEBHOOK_MAX_ENDPOINTS_PER_KEY={max_per_key}); delete one first"
            )
        session.add(row)
        shown = endpoint_object(row, secret=secret)
    return shown


def _load(db: Engine, owner: str | None, endpoint_id: str) -> WebhookEndpoint:
    if owner is None or not ENDPOINT_ID.fullmatch(endpoint_id):  # (nothing unstorable reaches the query)
        raise EndpointNotFound(f"No webhook endpoint found with id {endpoint_id[:64]!r}.")
    with db.connect() as conn:
        row = conn.execute(
            select(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.owner == owner)
        ).one_or_none()
    if row is None:
        raise EndpointNotFound(f"No webhook endpoint found with id {endpoint_id[:64]!r}.")
    return WebhookEndpoint(**row._mapping)


def get_endpoint(db: Engine, owner: str | None, endpoint_id: str) -> dict[str, Any]:
    return endpoint_object(_load(db, owner, endpoint_id))


def list_endpoints(db: Engine, owner: str | None, *, limit: int = 20, after: str | None = None) -> dict[str, Any]:
    """``owner``'s endpoints, newest first, as OpenAI's list page."""
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise ValueError(f"limit must be from 1 to {MAX_LIST_LIMIT}")
    stmt = (
        select(WebhookEndpoint)
        .where(WebhookEndpoint.owner == owner)
        .order_by(WebhookEndpoint.created_at.desc(), WebhookEndpoint.id.desc())
        .limit(limit + 1)
    )
    if after is not None:
        cursor = _load(db, owner, after)
        stmt = stmt.where(
            or_(
                WebhookEndpoint.created_at < cursor.created_at,
                and_(WebhookEndpoint.created_at == cursor.created_at, WebhookEndpoint.id < cursor.id),
            )
        )
    with db.connect() as conn:
        rows = [WebhookEndpoint(**r._mapping) for r in conn.execute(stmt)] if owner is not None else []
    data = [endpoint_object(r) for r in rows[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(rows) > limit,
    }


def update_endpoint(
    db: Engine,
    owner: str | None,
    endpoint_id: str,
    *,
    url: str | None = None,
    event_types: Sequence[str] | None = None,
    name: str | None = None,
    allow_loopback: bool = False,
) -> dict[str, Any]:
    row = _load(db, owner, endpoint_id)
    values: dict[str, Any] = {}
    if url is not None and url != row.url:
        check_url(url, allow_loopback=allow_loopback)
        values["url"] = url
    if event_types is not None:
        types = check_event_types(list(event_types))
        if types != list(row.event_types):
            values["event_types"] = types
    if name is not None and check_name(name) != row.name:
        values["name"] = name
    if values:
        values["updated_at"] = now()
        with db.begin() as conn:
            conn.execute(update(WebhookEndpoint).where(WebhookEndpoint.id == row.id).values(**values))
    return get_endpoint(db, owner, endpoint_id)


def delete_endpoint(db: Engine, owner: str | None, endpoint_id: str) -> dict[str, Any]:
    """Delete it; deliveries still pending to it fail (``webhook_dispatch``)."""
    row = _load(db, owner, endpoint_id)
    with db.begin() as conn:
        conn.execute(delete(WebhookEndpoint).where(WebhookEndpoint.id == row.id))
    return {"id": row.id, "object": "webhook_endpoint.deleted", "deleted": True}


def rotate_secret(db: Engine, owner: str | None, endpoint_id: str, *, keep_old: bool = False) -> dict[str, Any]:
    """A new signing secret (shown in the answer); with ``keep_old`` the previous one signs
    beside it for 24 hours, so a receiver can switch without missing an event."""
    row = _load(db, owner, endpoint_id)
    secret, t = new_secret(), now()
    with db.begin() as conn:
        conn.execute(
            update(WebhookEndpoint)
            .where(WebhookEndpoint.id == row.id)
            .values(
                secret=secret,
                previous_secret=row.secret if keep_old else None,
                previous_secret_until=t + ROTATION_GRACE_SECONDS if keep_old else None,
                updated_at=t,
            )
        )
    row.secret, row.updated_at = secret, t
    return endpoint_object(row, secret=secret)


def signing_secrets(row: WebhookEndpoint, t: float) -> list[str]:
    """The secrets a delivery to ``row`` is signed with at ``t``: the current one, and the
    previous one during its grace period."""
    keep = row.previous_secret is not None and (row.previous_secret_until or 0.0) > t
    return [row.secret, *([row.previous_secret] if keep and row.previous_secret else [])]
