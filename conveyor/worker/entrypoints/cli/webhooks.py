"""``conveyor webhooks``: the latest webhook deliveries (failed ones say why)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from conveyor.worker.core.terminal_text import printable
from conveyor.worker.entrypoints.cli.common import load_settings, open_database
from conveyor.worker.entrypoints.cli.errors import UserError
from conveyor.worker.entrypoints.cli.extra import worker_extra
from conveyor.worker.entrypoints.cli.formatting import print_json
from conveyor.worker.entrypoints.cli.options import at_least_one

with worker_extra():
    from conveyor.worker.core.settings import redact_url


def add_parser(sub: Any) -> None:
    hooks = sub.add_parser("webhooks", help="list webhook deliveries, latest first (failed ones say why)")
    hooks.add_argument(
        "--status", action="append", choices=["pending", "delivered", "failed"],
        help="only deliveries in this state (repeatable)",
    )  # fmt: skip
    hooks.add_argument("--limit", type=at_least_one, default=50, help="at most this many (default 50, at most 1000)")
    hooks.add_argument("--json", action="store_true", help="print them as JSON")
    hooks.set_defaults(fn=cmd_webhooks)


def cmd_webhooks(args: argparse.Namespace) -> int:
    from conveyor.worker.jobs.webhook_dispatch import MAX_LISTED, recent_deliveries
    from conveyor.worker.store.models import WebhookDeliveryStatus

    if args.limit > MAX_LISTED:
        raise UserError(f"--limit: at most {MAX_LISTED}")
    settings = load_settings()
    db = open_database(settings)
    try:
        rows = recent_deliveries(db, statuses=[WebhookDeliveryStatus(s) for s in args.status or ()], limit=args.limit)
    finally:
        db.dispose()
    for row in rows:
        row["url"] = redact_url(row["url"])
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("conveyor: no webhook deliveries" + (f" {'/'.join(args.status)}" if args.status else ""), file=sys.stderr)
    for row in rows:
        print(delivery_line(row))
    return 0


def delivery_line(row: dict[str, Any]) -> str:
    """One delivery on a line: when, its state and tries, the event, the job and where it goes."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["updated_at"]))
    line = (
        f"{when}  {row['status']:<9}  {row['attempts']:>3} attempts  {row['event_id']}  {row['type']}  "
        f"{row['job_id']}  {row['url']}"
    )
    if row["status"] == "pending" and row["attempts"]:
        line += f"  next try {time.strftime('%H:%M:%S', time.localtime(row['next_attempt_at']))}"
    if row["status"] != "delivered" and row["last_error"]:
        line += f"  last error: {printable(row['last_error'])}"
    return line
