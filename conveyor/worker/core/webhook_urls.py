"""Webhook destination URLs as written: ``https://`` (``http://`` only to a loopback host when
loopback is allowed, for development), a host, no credentials, a bounded length. Where the
host resolves to is checked at every delivery (``webhook_destination``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MAX_URL_CHARS = 2048
MAX_OPERATOR_URLS = 20
LOCALHOST = "localhost"


@dataclass(frozen=True)
class WebhookUrl:
    url: str
    scheme: str  # https | http
    host: str  # a name, or an address without brackets
    port: int
    target: str  # path and query, at least "/"


def is_loopback_name(host: str) -> bool:
    if host.lower() == LOCALHOST or host.lower().endswith("." + LOCALHOST):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def parse_url(url: str, *, allow_loopback: bool) -> WebhookUrl:
    """``url`` checked as written; ``ValueError`` naming what is wrong."""
    if not isinstance(url, str) or not url:
        raise ValueError("a webhook URL must be a non-empty string")
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"a webhook URL must be at most {MAX_URL_CHARS} characters, this one has {len(url)}")
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise ValueError("a webhook URL must not contain whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not a valid webhook URL: {exc}") from None
    scheme, host = parts.scheme.lower(), parts.hostname or ""
    if not host:
        raise ValueError("a webhook URL must name a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("a webhook URL must not carry credentials (user:password@)")
    if scheme == "http":
        if not (allow_loopback and is_loopback_name(host)):
            raise ValueError(
                "a webhook URL must be https:// (plain http:// only to a loopback host with "
                "CONVEYOR_WEBHOOK_ALLOW_LOOPBACK=1, for development)"
            )
    elif scheme != "https":
        raise ValueError(f"a webhook URL must be https://, not {scheme or 'without a scheme'}")
    if parts.fragment:
        raise ValueError("a webhook URL must not have a #fragment")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return WebhookUrl(url, scheme, host, port or (443 if scheme == "https" else 80), target)


def parse_webhook_urls(value: Any) -> tuple[str, ...]:
    """``CONVEYOR_WEBHOOK_URLS``: comma-separated URLs (or a list), each checked as written
    (https, or http allowed for now: the loopback rule is applied with the flag, at delivery)."""
    if value is None or value == "":
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    urls = tuple(str(item).strip() for item in items if str(item).strip())
    if len(urls) > MAX_OPERATOR_URLS:
        raise ValueError(f"at most {MAX_OPERATOR_URLS} webhook URLs, got {len(urls)}")
    for url in urls:
        try:
            parse_url(url, allow_loopback=True)
        except ValueError as exc:
            raise ValueError(f"{url[:100]!r}: {exc}") from None
    return tuple(dict.fromkeys(urls))
