"""A pytest plugin for the GPU check's pytest steps: each test's outcome, its figures
(``record_property``) and its failure text, appended to a JSON-lines file as pytest reports
it. A step stopped at its time limit never writes its junit file; this one still says what
ran and why each failure failed. Loaded with ``-p benchmarks.gpu_check.report_plugin``; the
file is ``CONVEYOR_GPU_CHECK_REPORTS``."""

from __future__ import annotations

import json
import os
from typing import Any

_IN_XDIST_WORKER = False


def pytest_configure(config: Any) -> None:
    # Under xdist the controller receives every worker's reports: only it writes.
    global _IN_XDIST_WORKER
    _IN_XDIST_WORKER = hasattr(config, "workerinput")


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get("CONVEYOR_GPU_CHECK_REPORTS")
    if not path or _IN_XDIST_WORKER or (report.when != "call" and report.passed):
        return
    entry: dict[str, Any] = {
        "test": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "seconds": round(report.duration, 2),
    }
    if report.failed:
        entry["message"] = report.longreprtext[-3000:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        entry["message"] = str(report.longrepr[-1])
    if report.user_properties:
        entry["properties"] = dict(report.user_properties)
    with open(path, "a") as f:
        f.write(json.dumps(entry, default=str) + "\n")
