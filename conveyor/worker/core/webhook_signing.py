"""Standard Webhooks signatures (https://www.standardwebhooks.com), as OpenAI signs its events.

A secret is ``whsec_`` and the base64 of 24 to 64 random bytes. A delivery carries three
headers: ``webhook-id`` (the event's id, the same on every retry), ``webhook-timestamp``
(Unix seconds of this attempt: receivers refuse old ones, so each retry is signed afresh) and
``webhook-signature``: ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``, one per
secret, space-separated (while an endpoint's secret is rotated both old and new sign).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Sequence

PREFIX = "whsec_"
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 24, 64
NEW_SECRET_BYTES = 32


def new_secret() -> str:
    """A fresh random secret in the ``whsec_`` format."""
    return PREFIX + base64.b64encode(secrets.token_bytes(NEW_SECRET_BYTES)).decode()


def secret_bytes(secret: str) -> bytes:
    """The key a ``whsec_`` secret encodes; ``ValueError`` saying what is wrong with it."""
    if not secret.startswith(PREFIX):
        raise ValueError("a webhook secret must start with 'whsec_' (the Standard Webhooks format)")
    try:
        key = base64.b64decode(secret[len(PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a webhook secret must be 'whsec_' followed by base64") from None
    if not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
        raise ValueError(
            f"a webhook secret must encode {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, this one has {len(key)}"
        )
    return key


def check_secret(secret: str) -> None:
    secret_bytes(secret)


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """One ``v1,<base64>`` signature of ``body`` under ``secret``."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_bytes(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(secrets_: Sequence[str], message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers of one attempt, signed with each of ``secrets_``."""
    if not secrets_:
        raise ValueError("no secret to sign the webhook with")
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(s, message_id, timestamp, body) for s in secrets_),
    }


def secret_hint(secret: str) -> str:
    """What an endpoint shows of its secret after creation: enough to tell two apart."""
    return f"{PREFIX}...{secret[-4:]}"
