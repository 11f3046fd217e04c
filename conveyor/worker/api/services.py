"""What the HTTP API's routes share: settings, the database, the object store, a send-only
Celery app on the workers' broker, the key verifier, and the upload slots. One per app,
created by the app factory (``conveyor.worker.api.app``) and closed with it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.engine import Engine

from conveyor.worker.broker.config import celery_app
from conveyor.worker.broker.queues import DEFAULT_QUEUE
from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.quotas import OwnerLocks
from conveyor.worker.store.api_keys import KeyVerifier
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.objects.base import ObjectStore
from conveyor.worker.store.objects.factory import open_store_from_settings


@dataclass
class ApiServices:
    settings: Settings
    db: Engine
    store: ObjectStore
    # No key needed (``conveyor serve --insecure-no-auth``, loopback only): everything is
    # owned by nobody (``owner`` None), as what the CLI creates.
    insecure: bool = False
    ready: tuple[float, dict[str, Any]] | None = None  # /readyz's last answer, and when
    started_at: float = field(default_factory=time.time)
    verifier: KeyVerifier = field(init=False)
    uploads: asyncio.Semaphore = field(init=False)
    uploads_by_owner: dict[str | None, int] = field(default_factory=dict)  # uploads streaming now, per key
    owner_locks: OwnerLocks = field(default_factory=OwnerLocks)  # one owner's quota checks queue here
    _broker: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.verifier = KeyVerifier(self.db)
        self.uploads = asyncio.Semaphore(self.settings.max_concurrent_uploads)

    @classmethod
    def open(cls, settings: Settings, *, insecure: bool = False) -> ApiServices:
        if settings.is_embedded:
            settings.ensure_home()
        db = create_db_engine(settings.database)
        return cls(settings, db, open_store_from_settings(settings), insecure=insecure)

    @property
    def broker(self) -> Any:
        """A send-only Celery app (messages go by name to the intake queue and model queues)."""
        if self._broker is None:
            with self._lock:
                if self._broker is None:
                    self._broker = celery_app(self.settings, DEFAULT_QUEUE)
        return self._broker

    def close(self) -> None:
        if self._broker is not None:
            self._broker.close()
            self._broker = None
        self.db.dispose()


async def get_services(request: Request) -> ApiServices:
    """The app's services (a FastAPI dependency; ``async`` as it does no I/O: no thread hop)."""
    services: ApiServices = request.app.state.services
    return services


Services = Annotated[ApiServices, Depends(get_services)]
