"""The GPU check's first step: the GPU tests under pytest, their outcome as JSON.

On a GPU (``CONVEYOR_TEST_GPU=1``) the kernel tests gain their bf16 cases and compile the
kernels, the backend and graph tests run on CUDA, and the teacher-forced bf16 logits test
runs at full model widths and records its figures (``record_property``), which land here.
The dry run runs a few of the same tests on CPU to prove the step and its parsing.

    python -m benchmarks.gpu_check.correctness --out correctness.json --work DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

GPU_TESTS = [
    "tests/kernels",
    "tests/engine/test_triton_backend.py",
    "tests/engine/test_cuda_graphs.py",
    "tests/engine/test_bf16_logits.py",
    "tests/engine/test_moe_fused_kernel.py",
]
# The ahead-of-time compile check is for machines without a GPU; here the kernels really run.
DESELECT = "not test_kernels_compile_for_gpu_without_spills"
DRY_RUN_TESTS = [
    "tests/kernels/test_kv_cache_write.py::test_write_kv_cache_all_skipped_and_empty",
    "tests/engine/test_bf16_logits.py::test_bf16_logits_at_real_model_shapes",
]
OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b.*?(tests/\S+::\S+)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--models", type=Path, default=None, help="(the shaped checkpoints: CONVEYOR_SHAPED_MODELS)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--workers", type=int, default=6, help="pytest-xdist processes (compiles run in parallel)")
    ap.add_argument("--test-timeout", type=int, default=150)
    ap.add_argument("--select", nargs=argparse.REMAINDER, default=None, help="pytest arguments instead of GPU_TESTS")
    args = ap.parse_args(argv)

    junit = args.work / f"{args.out.stem}.xml"  # (one per step that runs this)
    junit.unlink(missing_ok=True)
    reports = args.work / f"{args.out.stem}.jsonl"  # each test as pytest reports it (report_plugin)
    reports.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE", f"--junitxml={junit}"]
    cmd += ["-p", "benchmarks.gpu_check.report_plugin"]
    if args.select:  # a second, shorter call: what the first one found
        cmd += args.select
    else:
        cmd += DRY_RUN_TESTS if args.dry_run else [*GPU_TESTS, "-k", DESELECT]
    if not args.dry_run and importlib.util.find_spec("xdist"):
        cmd += ["-n", str(args.workers)]
    if importlib.util.find_spec("pytest_timeout"):
        cmd += [f"--timeout={args.test_timeout}"]
    print("$ " + " ".join(cmd), flush=True)
    # Stopped by the check's time limit: leave through ``finally``, writing what was seen.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    begin = time.monotonic()
    # Output goes through this process, line by line, so that a run stopped from outside still
    # leaves the outcomes it printed (parsed below when there is no junit file).
    env = dict(os.environ, CONVEYOR_GPU_CHECK_REPORTS=str(reports))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env)
    assert proc.stdout is not None
    printed: list[str] = []
    try:
        for line in proc.stdout:
            printed.append(line)
            print(line, end="", flush=True)
    finally:
        proc.wait()
        report = summarise(junit, reports, printed, proc.returncode, time.monotonic() - begin)
        args.out.write_text(json.dumps(report, indent=2))
    print(f"correctness: {report['counts']} in {report['seconds']:.0f}s")
    return (
        0 if report["counts"].get("failed", 0) + report["counts"].get("error", 0) == 0 and proc.returncode == 0 else 1
    )


def summarise(junit: Path, reports: Path, printed: list[str], returncode: int | None, seconds: float) -> dict[str, Any]:
    """Counts, failures with their messages, and the figures tests recorded; from the junit
    file, or (pytest was stopped before writing it) from what the report plugin wrote as each
    test ended, or else from the outcomes it printed."""
    report: dict[str, Any] = {"returncode": returncode, "seconds": round(seconds, 1)}
    if junit.exists():
        report.update(_from_junit(junit))
    elif reports.exists():
        report.update(_from_reports(reports))
    else:
        outcomes = {test: word for word, test in OUTCOME.findall("".join(printed))}
        counts: dict[str, int] = {}
        for word in outcomes.values():
            counts[word.lower()] = counts.get(word.lower(), 0) + 1
        report.update(
            complete=False,
            counts=counts,
            failures=[{"test": t, "message": "see the log"} for t, w in outcomes.items() if w in ("FAILED", "ERROR")],
            properties={},
        )
    return report


def _from_reports(path: Path) -> dict[str, Any]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures: list[dict[str, str]] = []
    properties: dict[str, dict[str, Any]] = {}
    latest: dict[str, dict[str, Any]] = {}  # a test's teardown report follows its call's
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        key = entry["test"]
        if key in latest and entry["outcome"] == "passed":
            continue
        if key in latest and "properties" in latest[key]:
            entry.setdefault("properties", latest[key]["properties"])
        latest[key] = entry
    for entry in latest.values():
        outcome = entry["outcome"]
        if outcome == "failed" and entry["when"] != "call":
            outcome = "error"  # a fixture's failure, as junit counts it
        counts[outcome] += 1
        if outcome in ("failed", "error"):
            failures.append({"test": entry["test"], "message": entry.get("message", "")})
        if entry.get("properties"):
            properties[entry["test"]] = entry["properties"]
    return {"complete": False, "counts": counts, "failures": failures, "properties": properties}


def _from_junit(path: Path) -> dict[str, Any]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures: list[dict[str, str]] = []
    properties: dict[str, dict[str, Any]] = {}
    slowest: list[tuple[float, str]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        slowest.append((float(case.get("time", 0) or 0), test))
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                if kind != "skipped":
                    text = (node.get("message") or "") + "\n" + (node.text or "")
                    failures.append({"test": test, "message": text.strip()[-3000:]})
                break
        counts[outcome] += 1
        props = {p.get("name", ""): _number(p.get("value", "")) for p in case.iter("property")}
        if props:
            properties[test] = props
    slowest.sort(reverse=True)
    return {
        "complete": True,
        "counts": counts,
        "failures": failures,
        "properties": properties,
        "slowest": [{"test": t, "seconds": round(s, 2)} for s, t in slowest[:10]],
    }


def _number(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


if __name__ == "__main__":
    raise SystemExit(main())
