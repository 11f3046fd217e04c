"""``celery -A conveyor.worker.app worker``: the public entry point Celery loads (the app itself is
built by ``conveyor.worker.broker.app``).

``conveyor.worker.app.app`` is built on first access from the ``CONVEYOR_*`` environment, so importing
this module has no side effects and a bad setting is reported in one line, not a traceback.
"""

from __future__ import annotations

from celery import Celery

from conveyor.worker.broker.app import create_app

_app: Celery | None = None


def __getattr__(name: str) -> Celery:
    if name not in ("app", "celery"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    global _app
    if _app is None:
        try:
            _app = create_app()
        except Exception as exc:  # a bad CONVEYOR_* value: say which, without a traceback
            raise SystemExit(f"conveyor: cannot configure the Celery app: {exc}") from None
    return _app
