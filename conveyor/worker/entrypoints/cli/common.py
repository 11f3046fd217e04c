"""What the commands share around the job system: the settings (command-line values on top),
the engine flags as settings, the client and the database they open."""

from __future__ import annotations

import argparse
from typing import Any

from conveyor.worker.entrypoints.cli.errors import UserError
from conveyor.worker.entrypoints.cli.extra import worker_extra
from conveyor.worker.entrypoints.cli.formatting import service_note
from conveyor.worker.entrypoints.engine_flags import check_engine_flags, given_engine_flags

with worker_extra():
    from conveyor.worker.core.settings import Settings, read_settings, redact_url
    from conveyor.worker.entrypoints.client import Client
    from conveyor.worker.jobs.catalog import is_declared
    from conveyor.worker.store.database import create_db_engine
    from conveyor.worker.store.models import JobStatus
    from conveyor.worker.store.schema import ensure_schema
    from conveyor.worker.store.workers import ModelService


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment; ``overrides`` (command-line values) win and are
    validated like the rest."""
    return read_settings(**overrides)


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Settings overrides for the engine flags given on the command line (``engine_flags``):
    ``CONVEYOR_ENGINE_ARGS`` with them on top (the flag wins); empty when none is."""
    given = given_engine_flags(args)
    if not given:
        return {}
    return {"engine_args": {**read_settings().engine_args, **given}}


def checked_engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``engine_overrides``, each flag's value first checked by the engine's config: a bad one
    is refused by its flag before anything loads."""
    try:
        check_engine_flags(given_engine_flags(args))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return engine_overrides(args)


def open_client(settings: Settings | None = None) -> Client:
    return Client(settings or load_settings())


def open_database(settings: Settings) -> Any:
    """The settings' database, with its schema checked (the embedded one migrated)."""
    if settings.is_embedded:
        settings.ensure_home()
    db = create_db_engine(settings.database)
    try:
        ensure_schema(settings, db)
    except BaseException:
        db.dispose()
        raise
    return db


def where(settings: Settings) -> str:
    """The database a command read, for when it found nothing there."""
    place = f"the database {redact_url(settings.database)}"
    if settings.database_url is None:
        place += f" (CONVEYOR_HOME={settings.home_dir}; set CONVEYOR_HOME or CONVEYOR_DATABASE_URL to read another)"
    return place


def waiting_note(client: Client, job: dict[str, Any]) -> tuple[ModelService | None, str | None]:
    """Who serves an unfinished ``job``'s model, and what to say while no live worker does
    (``status`` and ``results --follow`` repeat it); ``(None, None)`` for a job that ended."""
    if JobStatus(job["status"]).terminal:
        return None, None
    service = client.model_service(job["model"])
    return service, service_note(service, is_declared(client.settings, job["model"]))
