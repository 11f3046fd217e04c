"""``conveyor keys create | list | revoke``: the API keys of the HTTP API (``conveyor serve``)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from conveyor.worker.entrypoints.cli.common import load_settings, open_database
from conveyor.worker.entrypoints.cli.extra import worker_extra
from conveyor.worker.entrypoints.cli.formatting import print_json

with worker_extra():
    from conveyor.worker.store.api_keys import create_key, list_keys, revoke_key


def add_parser(sub: Any) -> None:
    keys = sub.add_parser("keys", help="API keys of the HTTP API (conveyor serve)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = keys_sub.add_parser("create", help="create a key; prints it once, alone on a line")
    create.add_argument("name", help="a name for the key: letters, digits, '.', '_', '-' (unique)")
    create.set_defaults(fn=cmd_keys_create)
    klist = keys_sub.add_parser("list", help="list keys (never the keys themselves)")
    klist.add_argument("--json", action="store_true", help="print them as JSON")
    klist.set_defaults(fn=cmd_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key: requests with it get 401 (within 2 s)")
    revoke.add_argument("name", help="the key's name")
    revoke.set_defaults(fn=cmd_keys_revoke)


def cmd_keys_create(args: argparse.Namespace) -> int:
    db = open_database(load_settings())
    try:
        info, key = create_key(db, args.name)
    finally:
        db.dispose()
    print(key, flush=True)  # alone on its line of stdout: `KEY=$(conveyor keys create NAME)`
    print(
        f"conveyor: created API key {info.name!r} ({info.id}); it is shown only this once: keep it",
        file=sys.stderr,
    )
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    db = open_database(load_settings())
    try:
        keys = list_keys(db)
    finally:
        db.dispose()
    if args.json:
        print_json([k.as_dict() for k in keys])
        return 0

    def when(t: float | None) -> str:
        return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))

    for k in keys:
        state = "active" if k.active else f"revoked {when(k.revoked_at)}"
        print(f"{k.name}  {k.id}  created {when(k.created_at)}  last used {when(k.last_used_at)}  {state}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    db = open_database(load_settings())
    try:
        info = revoke_key(db, args.name)
    finally:
        db.dispose()
    print(f"conveyor: API key {info.name!r} ({info.id}) is revoked", file=sys.stderr)
    return 0
