"""API keys for the HTTP API: created, verified, listed and revoked; only a hash is stored.

A key is ``sk-conveyor-`` followed by 43 URL-safe characters (32 random bytes). It is shown
once, when created (``conveyor keys create NAME``); the database keeps its SHA-256 (hex), so
a leaked database opens nothing. A key is found by its hash (unique), and the stored hash is
compared with ``hmac.compare_digest`` too. A revoked key stays in the table (its files and
batches keep their owner, its id) but opens nothing.

``last_used_at`` is written at most once per ``touch_seconds`` per key and process
(``KeyVerifier``), not once per request: a busy server would otherwise turn every read into
a database write.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from conveyor.worker.store.models import ApiKey, now

KEY_PREFIX = "sk-conveyor-"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Longer than any key this module makes; anything longer is refused before it is hashed.
MAX_KEY_CHARS = 256


class KeyNameError(ValueError):
    """A key name that is malformed, or taken."""


class KeyNotFound(LookupError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no such key"


@dataclass(frozen=True)
class KeyInfo:
    """What is shown of a key (never the key itself, nor its hash)."""

    id: str
    name: str
    created_at: float
    revoked_at: float | None
    last_used_at: float | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "created_at": self.created_at,
            "revoked_at": self.revoked_at,
            "last_used_at": self.last_used_at,
            "active": self.active,
        }


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise KeyNameError(
            "a key name is 1 to 128 letters, digits, '.', '_' or '-' (starting with a letter or digit), "
            f"got {name!r:.80}"
        )
    return name


def _info(row: Any) -> KeyInfo:
    return KeyInfo(row.id, row.name, row.created_at, row.revoked_at, row.last_used_at)


def create_key(db: Engine, name: str) -> tuple[KeyInfo, str]:
    """A new key named ``name`` (unique, revoked ones included): its info and the key itself,
    which is never stored and cannot be shown again."""
    check_name(name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    info = KeyInfo(f"key_{uuid.uuid4().hex}", name, now(), None, None)
    try:
        with db.begin() as conn:
            conn.execute(
                insert(ApiKey).values(id=info.id, name=name, key_hash=hash_key(key), created_at=info.created_at)
            )
    except IntegrityError:
        raise KeyNameError(f"a key named {name!r} exists already (names stay taken after a revoke)") from None
    return info, key


def list_keys(db: Engine) -> list[KeyInfo]:
    """Every key, oldest first."""
    stmt = select(ApiKey.id, ApiKey.name, ApiKey.created_at, ApiKey.revoked_at, ApiKey.last_used_at)
    with db.connect() as conn:
        return [_info(row) for row in conn.execute(stmt.order_by(ApiKey.created_at, ApiKey.id))]


def revoke_key(db: Engine, name: str) -> KeyInfo:
    """Revoke the key named ``name`` (a server that verified it in the last seconds takes it
    for those seconds more: ``KeyVerifier.cached``); revoking a revoked key changes nothing.
    ``KeyNotFound`` if there is none."""
    with db.begin() as conn:
        conn.execute(update(ApiKey).where(ApiKey.name == name, ApiKey.revoked_at.is_(None)).values(revoked_at=now()))
        row = conn.execute(
            select(ApiKey.id, ApiKey.name, ApiKey.created_at, ApiKey.revoked_at, ApiKey.last_used_at).where(
                ApiKey.name == name
            )
        ).one_or_none()
    if row is None:
        raise KeyNotFound(f"no key named {name!r} (conveyor keys list shows them)")
    return _info(row)


def active_key_count(db: Engine) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None))).scalar_one()
        )


def find_key(db: Engine, key: str) -> str | None:
    """The id of the active key ``key``, or None (unknown, revoked, or not a key at all)."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        return None
    digest = hash_key(key)
    with db.connect() as conn:
        row = conn.execute(
            select(ApiKey.id, ApiKey.key_hash).where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None))
        ).one_or_none()
    if row is None or not hmac.compare_digest(row.key_hash, digest):
        return None
    return str(row.id)


class KeyVerifier:
    """``verify(key)`` -> the key's id or None (a database read), recording its use
    (``last_used_at``) at most once per ``touch_seconds`` per key in this process.

    ``cached(key)`` answers without the database for a key verified in the last
    ``cache_seconds`` (None otherwise: then ``verify``): a busy client's requests skip the
    lookup, and a revoked key stops working within ``cache_seconds``. Only keys that were
    found are kept (by hash), at most ``MAX_CACHED``."""

    MAX_CACHED = 10_000

    def __init__(self, db: Engine, touch_seconds: float = 60.0, cache_seconds: float = 2.0) -> None:
        self.db, self.touch_seconds, self.cache_seconds = db, touch_seconds, cache_seconds
        self._touched: dict[str, float] = {}
        self._found: dict[str, tuple[str, float]] = {}  # key hash -> (key id, when verified)
        self._lock = threading.Lock()

    def cached(self, key: str) -> str | None:
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            return None
        hit = self._found.get(hash_key(key))
        if hit is None or time.monotonic() - hit[1] > self.cache_seconds:
            return None
        return hit[0]

    def verify(self, key: str) -> str | None:
        key_id = find_key(self.db, key)
        if key_id is None:
            return None
        with self._lock:
            if len(self._found) >= self.MAX_CACHED:
                self._found.clear()
            self._found[hash_key(key)] = (key_id, time.monotonic())
        self._touch(key_id)
        return key_id

    def _touch(self, key_id: str) -> None:
        t = time.monotonic()
        with self._lock:
            last = self._touched.get(key_id)
            if last is not None and t - last < self.touch_seconds:
                return
            self._touched[key_id] = t
        with self.db.begin() as conn:
            conn.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=now()))
