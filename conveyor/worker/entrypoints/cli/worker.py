"""``conveyor worker``: serve a model's queue (a Celery worker, threads pool)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from conveyor.worker.entrypoints.cli.common import checked_engine_overrides, load_settings
from conveyor.worker.entrypoints.cli.errors import UserError
from conveyor.worker.entrypoints.cli.extra import worker_extra
from conveyor.worker.entrypoints.cli.options import MODEL_HELP, add_concurrency, at_least_one, port, seconds
from conveyor.worker.entrypoints.engine_flags import add_engine_flags

with worker_extra():
    from conveyor.worker.broker.queues import queue_name, submit_queue_name
    from conveyor.worker.jobs.model_names import canonical_model
    from conveyor.worker.store.schema import ensure_schema


def add_parser(sub: Any) -> None:
    worker = sub.add_parser("worker", help="serve a model's queue (Celery worker, threads pool)")
    worker.add_argument("--model", help=MODEL_HELP + " (default CONVEYOR_MODEL)")
    worker.add_argument(
        "--served-model-name",
        help="the public name jobs and API batches use for this model (body.model); default: --model itself "
        "(CONVEYOR_SERVED_MODEL_NAME)",
    )
    add_concurrency(worker, "shard tasks")
    worker.add_argument(
        "--cpu-threads", type=at_least_one, metavar="N",
        help="torch's CPU threads, exactly (default CONVEYOR_CPU_THREADS, else the CPUs this process may use, from "
        "its affinity and cgroup CPU quota, tuned down while a busy neighbour makes fewer faster)",
    )  # fmt: skip
    worker.add_argument("--loglevel", help="DEBUG, INFO, WARNING... (default CONVEYOR_LOG_LEVEL, INFO)")
    worker.add_argument(
        "--metrics-port", type=port, help="serve Prometheus metrics at /metrics on this port (default "
        "CONVEYOR_METRICS_PORT; 0: none)",
    )  # fmt: skip
    worker.add_argument("--metrics-host", help="the metrics server's address (default CONVEYOR_METRICS_HOST, 0.0.0.0)")
    worker.add_argument(
        "--drain-timeout", type=seconds, metavar="SECONDS",
        help="on SIGTERM, let running shards finish for up to this long, then hand back what is left and exit 0 "
        "(default CONVEYOR_DRAIN_TIMEOUT_SECONDS, 25)",
    )  # fmt: skip
    worker.add_argument(
        "--exit-when-idle", type=seconds, metavar="SECONDS",
        help="drain and exit 0 once no task has come for this long (run-to-completion workers, e.g. a KEDA "
        "ScaledJob; default CONVEYOR_EXIT_WHEN_IDLE_SECONDS: never)",
    )  # fmt: skip
    add_engine_flags(worker)
    worker.set_defaults(fn=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    # The engine (see the package docstring).
    from conveyor.worker.broker.app import create_app
    from conveyor.worker.execution.context import WorkerContext

    base = load_settings()
    model = args.model or base.model
    if not model:
        raise UserError("no model to serve: pass --model or set CONVEYOR_MODEL")
    settings = load_settings(
        worker_concurrency=args.concurrency, model=canonical_model(model),
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, served_model_name=args.served_model_name,
        drain_timeout_seconds=args.drain_timeout, exit_when_idle_seconds=args.exit_when_idle,
        cpu_threads=args.cpu_threads, **checked_engine_overrides(args),
    )  # fmt: skip
    ctx = WorkerContext.create(settings, model)  # checks engine args and the schema up front
    try:
        ensure_schema(settings, ctx.db)
        ctx.store.check()
    finally:
        ctx.close()
    prefix = settings.queue_prefix
    queues = f"{queue_name(ctx.model, prefix)},{submit_queue_name(prefix)}"  # (intake: a lane of its own)
    app = create_app(settings)
    argv = [
        "worker", "--pool=threads", f"--concurrency={settings.worker_concurrency}", f"--queues={queues}",
        f"--loglevel={args.loglevel or settings.log_level}", "--without-gossip", "--without-mingle",
        f"--hostname=conveyor-{os.getpid()}@%h",
    ]  # fmt: skip
    app.worker_main(argv)
    return 0
