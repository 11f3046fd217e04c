"""``conveyor serve``: the OpenAI-compatible Files and Batches API over HTTP."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from typing import Any

from conveyor.worker.entrypoints.cli.common import load_settings, open_database
from conveyor.worker.entrypoints.cli.errors import UserError
from conveyor.worker.entrypoints.cli.extra import worker_extra
from conveyor.worker.entrypoints.cli.options import port

with worker_extra():
    from conveyor.worker.broker.queues import submit_queue_name
    from conveyor.worker.core.settings import Settings, redact_url
    from conveyor.worker.store.api_keys import active_key_count


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible Files and Batches API over HTTP")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port, default=8000, help="port (default 8000)")
    serve.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve without API keys (everything owned by nobody); only on a loopback --host",
    )
    serve.add_argument("--loglevel", help="debug, info, warning... (default CONVEYOR_LOG_LEVEL, INFO)")
    serve.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    serve.set_defaults(fn=cmd_serve)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    settings = load_settings()
    check_keys(settings, args)
    import uvicorn  # the HTTP stack (see the package docstring)

    from conveyor.worker.api.app import create_app
    from conveyor.worker.api.http_server import uvicorn_options

    app = create_app(settings, insecure=args.insecure_no_auth)
    where = f"http://{'[' + args.host + ']' if ':' in args.host else args.host}:{args.port}/v1"
    keys_note = "no keys: insecure" if args.insecure_no_auth else "API keys required"
    print(
        f"conveyor serve: OpenAI-compatible API at {where} ({keys_note}); database "
        f"{redact_url(settings.database)}, broker {redact_url(settings.broker)}, "
        f"storage {redact_url(settings.storage)}"
        + (f"; taking broker submissions from {submit_queue_name(settings.queue_prefix)}"
           if settings.api_takes_submissions else ""),
        file=sys.stderr,
        flush=True,
    )  # fmt: skip
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=(args.loglevel or settings.log_level).lower(),
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=30,
        **uvicorn_options(settings),
    )
    return 0


def check_keys(settings: Settings, args: argparse.Namespace) -> None:
    """Refuse to serve what no request could use (no key and no ``--insecure-no-auth``), or
    keyless on a reachable address; warn when keys exist but none is asked for."""
    if args.insecure_no_auth and not is_loopback(args.host):
        raise UserError(
            f"--insecure-no-auth serves without keys, so only on a loopback address (127.0.0.1, ::1), "
            f"not {args.host}; create a key with `conveyor keys create NAME` instead"
        )
    db = open_database(settings)
    try:
        keys = active_key_count(db)
    finally:
        db.dispose()
    if not keys and not args.insecure_no_auth:
        raise UserError(
            "no API key exists, so no request could be served: create one with `conveyor keys create NAME` "
            "(it prints the key once), or start with --insecure-no-auth on a loopback address to serve without keys"
        )
    if keys and args.insecure_no_auth:
        print(
            f"conveyor: warning: --insecure-no-auth: {keys} API key(s) exist but none is asked for; what they "
            "created is not visible without them",
            file=sys.stderr,
        )
