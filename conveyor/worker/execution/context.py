"""What a worker process holds for its whole life: settings, the database engine, the
object store, the model it serves, (created once, lazily, under a lock) its engine host,
its dependency gate (``dependency_gate``) and its quarantine lane (one group of suspect
items in the engine at a time: ``shard_runner``).

Observers above this layer (progress bars, Prometheus metrics) hear about stored items
through ``on_items`` and ``item_listeners`` (``items_stored``), and read the engine's state
through ``host_stats``, without this layer knowing them."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

from conveyor.engine import EngineConfig
from conveyor.engine.core.startup import process_start_time
from conveyor.worker.core.settings import ConfigError, Settings, redact_url
from conveyor.worker.execution.cold_start import ColdStart, ModelLoad
from conveyor.worker.execution.dependency_gate import DependencyGate
from conveyor.worker.execution.engine_host import EngineHost, HostStats
from conveyor.worker.execution.owner_slots import OwnerSlots
from conveyor.worker.execution.process_state import Phase, ProcessState
from conveyor.worker.execution.shard_affinity import ShardAffinity
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.model_names import canonical_model, check_served_name
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.faults import DATABASE, STORAGE
from conveyor.worker.store.items import ItemRecord
from conveyor.worker.store.model_cache import fetch_model, is_model_uri
from conveyor.worker.store.objects.base import ObjectStore
from conveyor.worker.store.objects.factory import open_store_from_settings

log = logging.getLogger(__name__)

# Called with the items a shard has just stored for the first time (never twice for one
# item from one process), on the shard's thread, after their commit.
ItemListener = Callable[[Sequence[ItemRecord]], None]


def engine_config(settings: Settings, model: str) -> EngineConfig:
    """``EngineConfig`` for ``model`` with ``CONVEYOR_ENGINE_ARGS`` applied. Jobs carry a
    priority and a deadline (``expires_at``), so the scheduler defaults to the ``priority``
    policy: the job's priority first, then the earliest deadline, then arrival order."""
    args = {"scheduling_policy": "priority", **settings.engine_args}
    if settings.cpu_threads is not None:
        given = settings.engine_args.get("cpu_threads")
        if given is not None and given != settings.cpu_threads:
            raise ConfigError(
                f"CONVEYOR_CPU_THREADS={settings.cpu_threads} and CONVEYOR_ENGINE_ARGS' cpu_threads={given!r} "
                "disagree; set one of them"
            )
        args["cpu_threads"] = settings.cpu_threads
    # The input budgets are the engine's fields too; CONVEYOR_ENGINE_ARGS may name them instead.
    args.setdefault("grammar_compile_seconds", settings.grammar_compile_seconds)
    args.setdefault("tokenize_seconds", settings.tokenize_seconds)
    known = EngineConfig.flat_field_names() - {"model"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(
            f"CONVEYOR_ENGINE_ARGS has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    try:
        return EngineConfig(model=model, **args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"CONVEYOR_ENGINE_ARGS: {exc}") from None


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class WorkerContext:
    settings: Settings
    db: Engine
    store: ObjectStore
    model: str  # what jobs name: the served name, else the checkpoint (canonical)
    checkpoint: str | None = None  # what the engine loads, when it is served under another name
    worker_id: str = field(default_factory=worker_id)
    host_factory: Callable[[], EngineHost] | None = None
    on_items: Callable[[int], None] | None = None  # progress: items newly stored
    item_listeners: list[ItemListener] = field(default_factory=list, repr=False)
    # Why the broker consumer takes no message it should now (None: it consumes), set by the
    # broker layer once the worker is ready; ``readiness`` reports it.
    consumer_problem: Callable[[], str | None] | None = field(default=None, repr=False)
    gate: DependencyGate = field(init=False, repr=False)
    state: ProcessState = field(default_factory=ProcessState, repr=False)
    quarantine: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # The shards each owner runs in this process (``execution/shard_turns.py``).
    owner_slots: OwnerSlots = field(init=False, repr=False)
    # The groups of shards served last, which the next turn prefers (``execution/shard_turns.py``).
    affinity: ShardAffinity = field(default_factory=ShardAffinity, repr=False)
    # The model's load (``host()``) and, once the worker is ready, its cold start by phase
    # (``mark_ready``): the log line and ``conveyor_worker_cold_start_seconds`` read it.
    model_load: ModelLoad | None = field(default=None, repr=False)
    model_download: float | None = field(default=None, repr=False)  # seconds fetching s3:// weights
    cold_start: ColdStart | None = field(default=None, repr=False)
    # A cancel aborts what the engine runs too, not only what waits: ``conveyor run`` on Ctrl-C.
    abort_running_on_cancel: bool = field(default=False, repr=False)
    _host: EngineHost | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        checks = {DATABASE: self._check_database, STORAGE: self.store.check}
        self.gate = DependencyGate(checks, backoff_max=self.settings.dependency_backoff_max_seconds)
        self.owner_slots = OwnerSlots(self.settings.shard_slots_per_owner)

    def _check_database(self) -> None:
        with self.db.connect() as conn:
            conn.execute(text("SELECT 1"))

    @classmethod
    def create(cls, settings: Settings, model: str | None = None, **kwargs: Any) -> WorkerContext:
        name = model or settings.model
        if not name:
            raise ConfigError("no model to serve: pass --model or set CONVEYOR_MODEL")
        canonical = canonical_model(name)
        served = settings.served_model_name
        if served is not None:
            kwargs["checkpoint"] = canonical
            canonical = check_served_name(served)
        if settings.is_embedded:
            settings.ensure_home()
        db = create_db_engine(settings.database)
        store = open_store_from_settings(settings)
        ctx = cls(settings, db, store, canonical, **kwargs)
        if ctx.host_factory is None:
            config = engine_config(settings, ctx.checkpoint or ctx.model)  # fail now on bad engine args
            ctx.host_factory = lambda: EngineHost.from_config(
                config.replace(model=ctx.local_checkpoint()),
                step_timeout=settings.step_timeout_seconds,
                input_threads=settings.input_threads,
            )
        return ctx

    def local_checkpoint(self) -> str:
        """What the engine loads: the checkpoint or model as named, except weights in an
        object store (``s3://...``), fetched into the model cache first (once per node)."""
        name = self.checkpoint or self.model
        if not is_model_uri(name):
            return name
        fetched = fetch_model(self.settings, name)
        self.model_download = fetched.seconds
        log.info(
            "model %s: %s (%d files, %.1f MiB; %d fetched) at %s",
            name, fetched.source, fetched.files, fetched.bytes / 2**20, fetched.downloaded_files, fetched.path,
        )  # fmt: skip
        return str(fetched.path)

    def host(self) -> EngineHost:
        """The process's engine host, loading the model on first use (once per process)."""
        host = self._host
        if host is not None and host.pid == os.getpid() and host.alive:
            return host
        with self._lock:
            if self._host is None or self._host.pid != os.getpid() or not self._host.alive:
                assert self.host_factory is not None
                log.info("loading model %s", self.checkpoint or self.model)
                started = time.time()
                self._host = self.host_factory()
                startup = getattr(self._host, "startup", None)  # (a test's stand-in host keeps none)
                self.model_load = ModelLoad(started, time.time(), self.model_download, startup)
            return self._host

    def mark_ready(self) -> ColdStart:
        """The worker is ready: measure its cold start (once) and log it."""
        if self.cold_start is None:
            started_at, source = process_start_time()
            self.cold_start = ColdStart.measure(started_at, source, self.model_load, time.time())
            log.info("conveyor worker: %s", self.cold_start.describe())
        return self.cold_start

    @property
    def host_started(self) -> bool:
        return self._host is not None

    def host_stats(self) -> HostStats | None:
        """The engine host's latest stats; None before the model is loaded (this never loads it)."""
        host = self._host
        return host.stats() if host is not None else None

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        """Alive unless the engine loop thread died (a hung step already exits the process)."""
        host = self._host
        if host is not None and host.pid == os.getpid() and not host.alive:
            return False, {"status": "engine loop thread died"}
        return True, {"status": "alive", "phase": self.state.phase.value}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready to take shards: schema and store checked, model loaded, consuming every queue
        it serves, not draining, and no dependency down."""
        phase = self.state.phase
        detail: dict[str, Any] = {"phase": phase.value, "model": self.model, "model_loaded": self.host_started}
        down = self.gate.down()
        if down:
            detail["down"] = down
        consumer = self.consumer_problem() if self.consumer_problem is not None else None
        if consumer is not None:
            detail["consumer"] = consumer
        ok = phase is Phase.ready and self.host_started and not down and consumer is None
        detail["status"] = "ready" if ok else "not ready"
        return ok, detail

    def items_stored(self, records: Sequence[ItemRecord]) -> None:
        """Tell ``on_items`` and each item listener that ``records`` were newly stored. A
        listener that raises is logged: observing never fails a shard."""
        if not records:
            return
        if self.on_items is not None:
            self.on_items(len(records))
        for listener in self.item_listeners:
            try:
                listener(records)
            except Exception:
                log.exception("item listener %r failed", listener)

    def job_store(self, job_id: str) -> ObjectStore:
        return self.store.scoped(object_keys.job_prefix(job_id))

    def describe(self) -> str:
        s = self.settings
        served = f" (checkpoint {self.checkpoint})" if self.checkpoint else ""
        return (
            f"model {self.model}{served}; database {redact_url(s.database)}, "
            f"broker {redact_url(s.broker)}, storage {redact_url(s.storage)}"
        )

    def close(self) -> None:
        self.gate.close()
        if self._host is not None:
            self._host.close()
        self.db.dispose()
