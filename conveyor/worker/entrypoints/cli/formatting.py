"""What the commands print about jobs: one-line summaries, progress in words, why nothing
succeeded, who serves a model."""

from __future__ import annotations

import json
import time
from typing import Any

from conveyor.worker.core.terminal_text import printable
from conveyor.worker.entrypoints.cli.extra import worker_extra

with worker_extra():
    from conveyor.worker.entrypoints.progress_bar import duration
    from conveyor.worker.store.workers import ModelService


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


def progress_text(job: dict[str, Any]) -> str | None:
    """A running job's rate, time left and tokens so far, in words (None when not running)."""
    p = job.get("progress")
    if not p:
        return None
    eta = duration(p["eta_seconds"]) if p["eta_seconds"] is not None else p.get("eta_note") or "unknown"
    if p["requests_per_second"] is None:
        rate = f"just started, ETA {eta}"
    else:
        rate = (
            f"{p['requests_per_second']:.2f} req/s and {p['output_tokens_per_second']:.0f} tok/s over the last "
            f"{p['window_seconds']:.0f} s, ETA {eta}"
        )
    return f"{p['done']}/{p['total']} done, {rate}, {p['output_tokens']:,} output tokens so far"


def summary(job: dict[str, Any]) -> str:
    """A job on one line: its status, counts, progress, files and errors."""
    c = job["request_counts"]
    parts = [f"{job['id']}  {job['status']}", f"{c['completed']} completed, {c['failed']} failed of {c['total']}"]
    if (progress := progress_text(job)) is not None:
        parts.append(progress)
    if job.get("output_uri"):
        parts.append(f"results: {job['output_uri']}")
    if job.get("error_uri") and c["failed"]:
        parts.append(f"errors: {job['error_uri']}")
    if job.get("errors"):
        parts.append(printable("; ".join(e.get("message", "") for e in job["errors"]["data"])))
    return "  |  ".join(parts)


def show(job: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(job)
    else:
        print(summary(job))


def run_summary(job: dict[str, Any], seconds: float, output: str | None, errors: str | None) -> str:
    """``conveyor run``'s last word, one short line starting with the job id: what came of its
    requests, where they went (the job's own files are under CONVEYOR_HOME; ``conveyor results`` reads them)."""
    c = job["request_counts"]
    text = (
        f"{job['id']} {job['status']} in {duration(seconds)}: {c['completed']} completed, "
        f"{c['failed']} failed of {c['total']}"
    )
    if job["status"] == "failed":  # the reason follows, as the error line
        return text
    places = [f"results in {output or 'stdout'}"]
    if c["failed"]:
        places.append(f"errors in {errors}" if errors else "errors: --errors FILE")
    return f"{text}; {', '.join(places)}"


def service_note(service: ModelService, declared: bool = False) -> str | None:
    """What to say when no live worker serves a job's model (None when one does); ``declared``:
    the model is in CONVEYOR_MODELS, so the deployment's autoscaler starts a worker for it."""
    if service.live:
        return None
    if declared:
        return f"no worker serves model {service.model} yet; it is declared (CONVEYOR_MODELS): an autoscaler starts one"
    start = f"start one with: conveyor worker --model {service.model}"
    if service.last_heartbeat_at is None:
        return f"no worker has ever served model {service.model}; {start}"
    age = max(0.0, time.time() - service.last_heartbeat_at)
    ago = f"{age / 60:.0f} min" if age >= 60 else f"{age:.0f} s"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(service.last_heartbeat_at))
    return f"no worker has served model {service.model} for {ago} (last heartbeat {when}); {start}"


def no_success_reason(job: dict[str, Any], errors_hint: str) -> str | None:
    """Why no request of a finished ``job`` succeeded (None if one did); ``errors_hint``
    says where the errors file is."""
    counts = job["request_counts"]
    if counts["completed"]:
        return None
    if job.get("errors"):
        return "; ".join(e.get("message", "") for e in job["errors"]["data"])
    total = counts["total"]
    if not total:
        return "the input has no requests"
    if not job.get("num_shards"):
        return f"all {total} lines were rejected, see {errors_hint}"
    return f"all {total} requests failed, see {errors_hint}"
