"""All worker configuration, read from ``CONVEYOR_*`` environment variables.

With nothing set, everything lives under ``CONVEYOR_HOME`` (default ``~/.conveyor``) and
needs no server: a SQLite database, a local-directory object store and kombu's SQLAlchemy
transport on SQLite as the broker. Production sets ``CONVEYOR_DATABASE_URL`` (Postgres),
``CONVEYOR_BROKER_URL`` (Redis, RabbitMQ, SQS) and ``CONVEYOR_STORAGE_URL``
(``s3://bucket/prefix``; any S3-compatible endpoint via ``AWS_ENDPOINT_URL`` or
``CONVEYOR_STORAGE_ENDPOINT_URL``).

The fields live in their groups (``conveyor.worker.core.setting_groups``: services, job
limits, API, quotas, sharding, worker, model cache, broker, faults, submissions, cache
sharing, reasoning, webhooks, metrics, processes); ``Settings`` inherits them all, so each keeps its
flat name (``settings.max_upload_bytes``) and its variable (``CONVEYOR_MAX_UPLOAD_BYTES``),
and holds the rules across groups.

URLs may carry passwords: never log them raw. ``repr(settings)`` and
``settings.safe_dict()`` redact them and the other secrets (the metrics token, the operator's
cache salt); use ``redact_url`` for anything else.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from pydantic import ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from conveyor.worker.core.limits import completion_window_seconds
from conveyor.worker.core.setting_groups.api import ApiSettings
from conveyor.worker.core.setting_groups.broker import BrokerSettings
from conveyor.worker.core.setting_groups.cache_sharing import CacheSharingSettings
from conveyor.worker.core.setting_groups.faults import FaultSettings
from conveyor.worker.core.setting_groups.job_limits import JobLimitSettings
from conveyor.worker.core.setting_groups.metrics import MetricsSettings
from conveyor.worker.core.setting_groups.model_cache import ModelCacheSettings
from conveyor.worker.core.setting_groups.process import ProcessSettings
from conveyor.worker.core.setting_groups.quotas import QuotaSettings
from conveyor.worker.core.setting_groups.reasoning import ReasoningSettings
from conveyor.worker.core.setting_groups.services import ServiceSettings
from conveyor.worker.core.setting_groups.sharding import ShardingSettings
from conveyor.worker.core.setting_groups.submissions import SubmissionSettings
from conveyor.worker.core.setting_groups.webhooks import WebhookSettings
from conveyor.worker.core.setting_groups.worker import WorkerSettings

_SECRET_QUERY_KEYS = re.compile(r"pass|secret|token|signature|credential|key", re.IGNORECASE)
_URL_FIELDS = ("database_url", "broker_url", "storage_url", "storage_endpoint_url")
# Secrets that are not URLs: shown as "***" when set.
_SECRET_FIELDS = ("metrics_token", "unowned_cache_salt", "webhook_secret")


class ConfigError(ValueError):
    """The configuration cannot work (the message names the setting)."""


def redact_url(url: str | None) -> str | None:
    """``url`` with any password and secret-looking query values replaced by ``***``.

    ``postgresql://u:pw@h/db`` -> ``postgresql://u:***@h/db``; ``redis://:pw@h`` ->
    ``redis://:***@h``; ``...?password=x&X-Amz-Signature=y`` -> both values ``***``.
    """
    if url is None:
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url redacted>"
    out = url
    if "@" in parts.netloc:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        user, sep, _password = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if sep else parts.netloc
        out = out.replace(f"//{parts.netloc}", f"//{netloc}", 1)
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        query = urlencode([(k, "***" if _SECRET_QUERY_KEYS.search(k) else v) for k, v in pairs], safe="*")
        out = out.replace(f"?{parts.query}", f"?{query}", 1)
    return out


# pydantic collects fields from the last base to the first: the groups are listed in reverse,
# so the fields (and the settings reference) read from ``home`` to ``log_level``.
class Settings(
    ProcessSettings,
    MetricsSettings,
    WebhookSettings,
    ReasoningSettings,
    CacheSharingSettings,
    SubmissionSettings,
    FaultSettings,
    BrokerSettings,
    ModelCacheSettings,
    WorkerSettings,
    ShardingSettings,
    QuotaSettings,
    ApiSettings,
    JobLimitSettings,
    ServiceSettings,
    BaseSettings,
):
    """Conveyor's settings. Every field reads ``CONVEYOR_<FIELD NAME>``."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore", frozen=True)

    @model_validator(mode="after")
    def _check_consistency(self) -> Settings:
        try:
            completion_window_seconds(self.completion_window, self.min_completion_window_seconds)
        except ValueError as exc:
            raise ValueError(f"CONVEYOR_COMPLETION_WINDOW: {exc}") from None
        if self.shard_size > self.max_shard_size:
            raise ValueError(
                f"CONVEYOR_SHARD_SIZE={self.shard_size} exceeds CONVEYOR_MAX_SHARD_SIZE={self.max_shard_size}"
            )
        if self.heartbeat_seconds * 2 > self.lease_seconds:
            raise ValueError(
                f"CONVEYOR_HEARTBEAT_SECONDS={self.heartbeat_seconds} must be at most half of "
                f"CONVEYOR_LEASE_SECONDS={self.lease_seconds}, or a slow heartbeat loses the lease"
            )
        if self.webhook_urls and not self.webhook_secret:
            raise ValueError("CONVEYOR_WEBHOOK_URLS needs CONVEYOR_WEBHOOK_SECRET (whsec_...) to sign the events")
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"CONVEYOR_DEFAULT_MAX_TOKENS={self.default_max_tokens} exceeds CONVEYOR_MAX_TOKENS={self.max_tokens}"
            )
        return self

    # ---- resolved locations -------------------------------------------------------------

    @property
    def model_cache_dir(self) -> Path:
        """Where ``s3://`` weights are downloaded (``CONVEYOR_MODEL_CACHE``)."""
        if self.model_cache is not None:
            return self.model_cache.expanduser().resolve()
        hf_home = os.environ.get("HF_HOME")
        if hf_home:
            return Path(hf_home).expanduser().resolve() / "conveyor-models"
        return self.home_dir / "models"

    # ---- safe display -------------------------------------------------------------------

    def safe_dict(self) -> dict[str, Any]:
        """All settings plus the resolved URLs, with secrets redacted: safe to log."""
        data = self.model_dump(mode="json")
        for name in _URL_FIELDS:
            data[name] = redact_url(data[name])
        for name in _SECRET_FIELDS:
            data[name] = "***" if data[name] else data[name]
        data["webhook_urls"] = [redact_url(url) for url in self.webhook_urls]  # a token may ride in a query
        data["resolved"] = {
            "database": redact_url(self.database),
            "broker": redact_url(self.broker),
            "storage": redact_url(self.storage),
        }
        return data

    def __repr_args__(self):  # used by repr() and str()
        for name, value in super().__repr_args__():
            if name in _SECRET_FIELDS and value:
                value = "***"
            if name == "webhook_urls":
                value = tuple(redact_url(url) for url in value)
            yield name, (redact_url(value) if name in _URL_FIELDS else value)


def read_settings(**overrides: Any) -> Settings:
    """Settings from the environment, ``overrides`` (command-line values, None = unset)
    winning; ``ConfigError`` naming each variable that is wrong and why."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(f"invalid settings: {'; '.join(_problem(e) for e in exc.errors())}") from None
    except SettingsError as exc:  # a value that could not even be parsed (e.g. JSON)
        field = _UNPARSEABLE_FIELD.search(str(exc))
        name = f"CONVEYOR_{field.group(1).upper()}" if field else "a CONVEYOR_* variable"
        cause = exc.__cause__
        what = f"is not valid JSON ({cause})" if isinstance(cause, ValueError) else f"cannot be read ({cause or exc})"
        raise ConfigError(f"invalid settings: {name} {what}") from None


_UNPARSEABLE_FIELD = re.compile(r'field "(\w+)"')


def _problem(error: Any) -> str:
    """One pydantic error as ``CONVEYOR_FIELD: what``; a rule across fields says its own names."""
    message = str(error["msg"]).removeprefix("Value error, ")
    field = "_".join(str(part) for part in error["loc"]).upper()
    return f"CONVEYOR_{field}: {message}" if field else message


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return read_settings()
