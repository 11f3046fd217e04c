"""The worker extra, optional: a base install (``pip install conveyor``, no ``worker`` extra) has
the engine and the parser, not the job system.

The command modules import the job system inside ``worker_extra()``: where a module of the
extra is missing, the import stops there, ``conveyor --help`` still works, and ``main`` says in
one line which extra to install instead of a traceback. Any other missing module is a bug: raised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

WORKER_EXTRA_MODULES = frozenset(
    {"kombu", "celery", "sqlalchemy", "alembic", "boto3", "botocore", "pydantic", "pydantic_settings", "psycopg",
     "redis", "prometheus_client", "fastapi", "starlette", "uvicorn", "multipart", "python_multipart"}
)  # fmt: skip

_missing: list[str] = []


@contextmanager
def worker_extra() -> Iterator[None]:
    """Imports of the job system: a module of the worker extra that is not installed is noted
    (``missing_extra``), not raised."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in WORKER_EXTRA_MODULES:
            raise
        _missing.append(exc.name or "")


def missing_extra() -> str | None:
    """The first module of the worker extra found missing, or None with the extra installed."""
    return _missing[0] if _missing else None
