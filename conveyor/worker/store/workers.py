"""The worker registry: which worker process serves which model, and when it last said so.

Each worker records itself when it starts (``starting``), beats every few seconds while it
consumes (``ready``) and records how it ended (``stopped``, or ``failed`` with the reason).
``submit`` warns and ``status`` explains when no live worker serves a job's model: otherwise
a job for a model nobody serves (a typo, a worker that could not load it) just waits.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

from sqlalchemy import case, delete, exists, func, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import aliased

from conveyor.worker.store.models import Worker, WorkerState, now


def register_worker(db: Engine, model: str, queue: str, *, checkpoint: str | None = None) -> str:
    """Record this process as a ``starting`` worker of ``model`` (served from ``checkpoint``
    when that is another name); returns its registry id."""
    worker_id = uuid.uuid4().hex
    t = now()
    with db.begin() as conn:
        conn.execute(
            insert(Worker).values(
                id=worker_id, hostname=socket.gethostname()[:256], pid=os.getpid(), model=model,
                queue=queue, checkpoint=checkpoint, state=WorkerState.starting, started_at=t, heartbeat_at=t,
            )
        )  # fmt: skip
    return worker_id


def set_worker_state(db: Engine, worker_id: str, state: WorkerState | None = None, error: str | None = None) -> None:
    """Beat (``heartbeat_at`` = now), and move to ``state`` if given (``error``: why it failed)."""
    values: dict[str, object] = {"heartbeat_at": now()}
    if state is not None:
        values["state"] = state
    if error is not None:
        values["error"] = error[:2000]
    with db.begin() as conn:
        conn.execute(update(Worker).where(Worker.id == worker_id).values(**values))


@dataclass(frozen=True)
class ModelService:
    """Who serves a model: live workers now, and the last heartbeat of any that ever did."""

    model: str
    live: int
    last_heartbeat_at: float | None  # None: no worker ever served it

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "live_workers": self.live, "last_heartbeat_at": self.last_heartbeat_at}


def model_service(db: Engine, model: str, live_seconds: float) -> ModelService:
    """Workers that served ``model``: those ``ready`` with a heartbeat in the last
    ``live_seconds`` are live. A worker that failed to start never counts as serving."""
    serving = (Worker.model == model, Worker.state.in_((WorkerState.ready, WorkerState.stopped)))
    live_now = (Worker.model == model, Worker.state == WorkerState.ready, Worker.heartbeat_at >= now() - live_seconds)
    with db.connect() as conn:
        last = conn.execute(select(func.max(Worker.heartbeat_at)).where(*serving)).scalar_one_or_none()
        live = conn.execute(select(func.count()).select_from(Worker).where(*live_now)).scalar_one()
    return ModelService(model, int(live), None if last is None else float(last))


@dataclass(frozen=True)
class ServedModel:
    """A model some worker has served (``ready`` at some point): how many serve it now, and
    since when any has."""

    model: str
    live: int
    first_started_at: float


def served_ever(db: Engine, live_seconds: float) -> list[ServedModel]:
    """Every model a worker has served (a worker that failed to start never counts), with its
    live workers (``ready``, a heartbeat in the last ``live_seconds``), by name. The registry
    keeps the newest worker of each model however old (``prune_workers``), so a model once
    served stays here."""
    live = (Worker.state == WorkerState.ready) & (Worker.heartbeat_at >= now() - live_seconds)
    stmt = (
        select(Worker.model, func.sum(case((live, 1), else_=0)), func.min(Worker.started_at))
        .where(Worker.state.in_((WorkerState.ready, WorkerState.stopped)))
        .group_by(Worker.model)
        .order_by(Worker.model)
    )
    with db.connect() as conn:
        return [ServedModel(str(m), int(n or 0), float(since)) for m, n, since in conn.execute(stmt)]


def prune_workers(db: Engine, older_than: float) -> int:
    """Forget workers whose last heartbeat is more than ``older_than`` seconds old, keeping the
    newest of each model (``model_service`` reads when a model was last served). Serverless
    workers come and go by the thousand; without this the registry only grows. Returns how
    many rows went."""
    newer = aliased(Worker)
    stmt = delete(Worker).where(
        Worker.heartbeat_at < now() - older_than,
        exists().where(newer.model == Worker.model, newer.heartbeat_at > Worker.heartbeat_at),
    )
    with db.begin() as conn:
        return conn.execute(stmt.execution_options(synchronize_session=False)).rowcount
