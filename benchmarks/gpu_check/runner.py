"""Runs the GPU check's steps one after another, each in its own process group with a time
limit, into one log and one JSON summary that is rewritten after every step (a run cut off
from outside still leaves what it measured)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from benchmarks.gpu_check.steps import Step

SUMMARY = "gpu_check.json"
LOG = "gpu_check.log"
# Seconds a step gets after SIGTERM to write what it has before SIGKILL.
GRACE_S = 5.0


@dataclass
class StepResult:
    name: str
    what: str
    status: str  # ok | failed | timeout | skipped
    seconds: float
    limit_s: float
    returncode: int | None
    tail: str  # the last lines it printed: the reason, when it failed
    results: dict[str, Any]  # its output files, parsed


class CheckRun:
    def __init__(self, out: Path, budget_s: float, env: dict[str, str], summary: dict[str, Any]) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.env = env
        self.summary = summary
        self.summary.setdefault("steps", [])
        out.mkdir(parents=True, exist_ok=True)
        self.log: TextIO = open(out / LOG, "a", buffering=1)  # noqa: SIM115  (closed in close())

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def run(self, step: Step) -> StepResult:
        left = self.deadline - time.monotonic()
        limit = min(step.limit_s, left - GRACE_S)
        if limit < 5:
            result = StepResult(step.name, step.what, "skipped", 0.0, 0.0, None, "no time left in the budget", {})
            return self._record(result)
        self.say(f"\n=== {step.name} (limit {limit:.0f}s): {step.what}")
        self.say("$ " + " ".join(step.argv))
        begin = time.monotonic()
        proc = subprocess.Popen(
            step.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=self.env,
            start_new_session=True,  # its own process group: a timeout stops its children too
        )
        lines: list[str] = []
        timed_out = _pump(proc, lines, self.log, begin + limit)
        if timed_out:
            self.say(f"=== {step.name}: over its {limit:.0f}s limit, stopping it")
            _stop_group(proc)
        seconds = time.monotonic() - begin
        status = "timeout" if timed_out else ("ok" if proc.returncode == 0 else "failed")
        tail = "".join(lines[-40:])
        results = {name: _read_json(self.out / name) for name in step.outputs}
        result = StepResult(
            step.name, step.what, status, round(seconds, 1), round(limit, 1), proc.returncode, tail, results
        )
        self.say(f"=== {step.name}: {status} in {seconds:.0f}s")
        return self._record(result)

    def _record(self, result: StepResult) -> StepResult:
        self.summary["steps"].append(vars(result))
        self.write_summary()
        return result

    def write_summary(self) -> None:
        path = self.out / SUMMARY
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.summary, indent=2, default=str))
        tmp.replace(path)

    def close(self) -> None:
        self.log.close()


def _pump(proc: subprocess.Popen, lines: list[str], log: TextIO, deadline: float) -> bool:
    """Copy the step's output to the console and the log (in a thread: a progress bar's line
    may never end) while waiting for it; True if it outlived ``deadline``."""
    assert proc.stdout is not None
    copier = threading.Thread(target=_copy, args=(proc.stdout, lines, log), daemon=True)
    copier.start()
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return True
    copier.join(timeout=10)
    return False


def _copy(stream: TextIO, lines: list[str], log: TextIO) -> None:
    for line in stream:
        lines.append(line)
        print(line, end="", flush=True)
        log.write(line)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, then SIGKILL after the grace period."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        return {"unreadable": str(exc)}
