"""The settings of webhooks."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import NoDecode

from conveyor.worker.core.webhook_signing import check_secret
from conveyor.worker.core.webhook_urls import parse_webhook_urls


class WebhookSettings(BaseModel):
    """Webhooks.

    OpenAI's ``batch.*`` events (``conveyor.worker.jobs.webhook_dispatch``), signed the Standard
    Webhooks way. The operator's endpoints get every job's events, whatever door it came in by.
    """

    # The operator's endpoints, comma-separated https:// URLs (each checked at every delivery).
    webhook_urls: Annotated[tuple[str, ...], NoDecode] = ()
    # The operator endpoints' signing secret, ``whsec_<base64>`` (Standard Webhooks); needed with ``webhook_urls``.
    webhook_secret: str | None = Field(None, max_length=200)
    # Development only: loopback destinations are allowed (and plain http:// to them).
    webhook_allow_loopback: bool = False
    # A delivery's connect and read timeouts, each, in seconds.
    webhook_timeout_seconds: float = Field(10.0, gt=0, le=60)
    # A failing delivery is retried (backoff from 1 s doubling to an hour) for this long after its event, then failed.
    webhook_max_age_seconds: float = Field(86_400.0, gt=0, le=7 * 86_400)
    # How often each process looks for events to fan out and deliveries that are due.
    webhook_poll_seconds: float = Field(1.0, gt=0, le=300)
    # The most endpoints one API key may register (``POST /v1/webhooks``).
    webhook_max_endpoints_per_key: int = Field(10, ge=1, le=100)
    # A PEM bundle of the CAs destinations' certificates may chain to, instead of the system's (tests, private CAs).
    webhook_ca_bundle: Path | None = None
    # ``conveyor run`` waits up to this long before it exits for its job's webhooks to be delivered.
    webhook_drain_seconds: float = Field(10.0, ge=0, le=600)

    @field_validator("webhook_urls", mode="before")
    @classmethod
    def _parse_webhook_urls(cls, value: Any) -> tuple[str, ...]:
        return parse_webhook_urls(value)

    @field_validator("webhook_secret")
    @classmethod
    def _check_webhook_secret(cls, value: str | None) -> str | None:
        if value is not None:
            check_secret(value)
        return value
