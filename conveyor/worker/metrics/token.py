"""The scraper's token (``CONVEYOR_METRICS_TOKEN``), checked on every ``/metrics`` Conveyor serves."""

from __future__ import annotations

import hmac


def token_matches(token: str | None, authorization: str | None) -> bool:
    """True when no token is set, or ``authorization`` is ``Bearer <token>``."""
    if not token:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
