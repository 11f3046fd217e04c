"""``conveyor db upgrade``: the database schema, migrated."""

from __future__ import annotations

import argparse
from typing import Any

from conveyor.worker.entrypoints.cli.common import load_settings
from conveyor.worker.entrypoints.cli.extra import worker_extra

with worker_extra():
    from conveyor.worker.core.settings import redact_url
    from conveyor.worker.store.schema import upgrade_database


def add_parser(sub: Any) -> None:
    db = sub.add_parser("db", help="database schema")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    upgrade = db_sub.add_parser("upgrade", help="apply the migrations (creates the schema)")
    upgrade.set_defaults(fn=cmd_db_upgrade)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    settings = load_settings()
    if settings.database_url is None:
        settings.ensure_home()
    revision = upgrade_database(settings.database)
    print(f"database {redact_url(settings.database)} is at schema revision {revision}")
    return 0
