"""The GPU check (``benchmarks/gpu_check``) cannot rot between GPU loans: its dry run, the same
steps on CPU with tiny shapes and Triton's interpreter, runs here end to end; and its runner
keeps going past a step that fails or runs out of time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check.carry_size import LIMIT_BYTES, carried_bytes
from benchmarks.gpu_check.correctness import summarise
from benchmarks.gpu_check.kernel_plan import cases
from benchmarks.gpu_check.runner import LOG, SUMMARY, CheckRun
from benchmarks.gpu_check.steps import Step, plan
from tests.engine.family_shapes import FAMILY_SHAPES

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_the_dry_run_runs_every_step_and_writes_every_file(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out), "--work", str(work)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((out / SUMMARY).read_text())
    steps = plan(out, work, dry_run=True)
    assert [s["name"] for s in summary["steps"]] == [s.name for s in steps]
    assert all(s["status"] == "ok" for s in summary["steps"]), [(s["name"], s["tail"]) for s in summary["steps"]]
    for step in steps:
        for name in step.outputs:  # each output written, and the same in the summary
            assert (
                json.loads((out / name).read_text())
                == next(s for s in summary["steps"] if s["name"] == step.name)["results"][name]
            )
    env = summary["environment"]
    assert env["packages"]["torch"] and env["cuda_available"] is False and summary["dry_run"] is True
    log = (out / LOG).read_text()
    assert all(f"=== {s.name}" in log for s in steps)

    results = {s["name"]: s["results"] for s in summary["steps"]}
    kernels = results["kernel_shapes"]["kernel_shapes.json"]
    assert {c["name"] for c in kernels["cases"]} == {c.name for c in cases(dry=True)}
    assert kernels["counts"] == {"pass": len(cases(dry=True)), "fail": 0, "error": 0}, kernels["cases"]
    assert all(c["rel_err"] < 1e-3 and c["median_ms"] > 0 for c in kernels["cases"])
    models = results["models"]["models.json"]
    assert models["counts"]["passed"] == len(FAMILY_SHAPES), models
    assert {t.rsplit("[", 1)[1].rstrip("]") for t in models["properties"]} == set(FAMILY_SHAPES)
    assert all(f["ours_mean"] > 0 and f["positions"] > 0 for f in models["properties"].values())
    correctness = results["correctness"]["correctness.json"]
    assert correctness["complete"] and correctness["counts"]["failed"] == 0 and correctness["counts"]["passed"] >= 3
    figures = correctness["properties"]  # the bf16 test's figures at both model shapes
    assert {t.rsplit("[", 1)[1].rstrip("]") for t in figures} == {"qwen3-0.6b", "llama-3.1-8b"}
    assert all(f["flips"] == 0 and f["ours_mean"] > 0 for f in figures.values())
    throughput = results["throughput"]["throughput.json"]
    assert set(throughput["systems"]) == {"engine", "hf_static", "hf_continuous"}
    for system in throughput["systems"].values():  # the same sequences, every token asked for
        assert system["output_tokens"] == throughput["workload"]["output_tokens"] and system["output_tok_s"] > 0
    roofline = results["roofline"]["roofline.json"]
    assert len(roofline["rows"]) == 4 and all(r["decode_only"] for r in roofline["rows"])
    assert all(r["bytes_per_step"] > roofline["weight_bytes"] for r in roofline["rows"])
    assert results["cuda_graphs"]["cuda_graphs.json"]["graph_replays_by_bucket"]
    moe = results["moe"]["moe.json"]["shapes"]["dry-run"]["rows"]
    assert [r["tokens"] for r in moe] == [1, 7] and all(r["max_abs_err_vs_torch"] < 1e-4 for r in moe)


def _step(name: str, code: str, limit_s: float = 30) -> Step:
    return Step(name, f"test step {name}", [sys.executable, "-c", code], limit_s)


def test_a_step_that_fails_or_outlives_its_limit_is_recorded_and_the_next_still_runs(tmp_path):
    summary: dict = {}
    run = CheckRun(tmp_path, budget_s=120, env=_env(), summary=summary)
    try:
        slow = run.run(_step("slow", "import time; print('started', flush=True); time.sleep(60)", limit_s=8))
        broken = run.run(_step("broken", "raise SystemExit('the reason it failed')"))
        fine = run.run(_step("fine", "print('all good')"))
    finally:
        run.close()
    assert (slow.status, broken.status, fine.status) == ("timeout", "failed", "ok")
    assert slow.seconds < 20 and "started" in slow.tail
    assert broken.returncode == 1 and "the reason it failed" in broken.tail
    written = json.loads((tmp_path / SUMMARY).read_text())
    assert [s["status"] for s in written["steps"]] == ["timeout", "failed", "ok"]
    assert "all good" in (tmp_path / LOG).read_text()


def test_steps_left_without_time_in_the_budget_are_skipped(tmp_path):
    summary: dict = {}
    run = CheckRun(tmp_path, budget_s=12, env=_env(), summary=summary)
    try:
        first = run.run(_step("first", "import time; time.sleep(30)", limit_s=30))
        second = run.run(_step("second", "print('never')"))
    finally:
        run.close()
    assert first.status == "timeout" and first.limit_s <= 7  # cut to the budget, less the grace
    assert second.status == "skipped" and "never" not in (tmp_path / LOG).read_text()


def test_pytest_stopped_before_its_junit_file_still_reports_what_it_printed(tmp_path):
    printed = [
        "[gw0] [ 10%] PASSED tests/kernels/test_fused_ops.py::test_rms_norm[a]\n",
        "[gw1] [ 20%] FAILED tests/engine/test_cuda_graphs.py::test_decode_graphs_match_transformers\n",
        "[gw0] [ 30%] SKIPPED tests/engine/test_bf16_logits.py::test_x[y]\n",
    ]
    report = summarise(tmp_path / "missing.xml", tmp_path / "missing.jsonl", printed, -15, 12.0)
    assert report["complete"] is False and report["returncode"] == -15
    assert report["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert report["failures"][0]["test"] == "tests/engine/test_cuda_graphs.py::test_decode_graphs_match_transformers"


def test_each_test_is_reported_as_it_ends_once_under_xdist(tmp_path):
    """The report plugin writes each outcome, its figures and its failure text as pytest
    reports it (the controller alone under xdist): what a step stopped at its limit leaves."""
    (tmp_path / "test_sample.py").write_text(
        "def test_ok(record_property):\n    record_property('ours_mean', 0.5)\n\n"
        "def test_bad():\n    assert 1 == 2, 'the figures differ'\n"
    )
    reports = tmp_path / "reports.jsonl"
    env = dict(os.environ, CONVEYOR_GPU_CHECK_REPORTS=str(reports), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.gpu_check.report_plugin"]
    proc = subprocess.run(
        [*cmd, "-n", "2", "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(reports.read_text().splitlines()) == 2, reports.read_text()
    report = summarise(tmp_path / "missing.xml", reports, [], -15, 3.0)
    assert report["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}
    [failure] = report["failures"]
    assert failure["test"].endswith("test_sample.py::test_bad") and "the figures differ" in failure["message"]
    [(test, figures)] = report["properties"].items()
    assert test.endswith("::test_ok") and figures == {"ours_mean": 0.5}


def test_an_unknown_step_is_refused_by_name(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(tmp_path), "--only", "warp-drive"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown steps ['warp-drive']" in proc.stderr


def test_the_carried_tree_fits_and_the_wheels_are_pinned():
    assert carried_bytes([]) < LIMIT_BYTES // 2  # room left for the wheels (about 3 MiB today)
    lines = (ROOT / "benchmarks/gpu_check/wheels.txt").read_text().splitlines()
    wanted = [line for line in lines if line.strip() and not line.startswith("#")]
    assert {w.split("==")[0] for w in wanted} >= {"llguidance", "gguf"}
    assert all("==" in w for w in wanted)  # one version of each: two would stop the install


@pytest.mark.skipif(sys.platform != "linux", reason="run.sh is the lent (Linux) GPU machine's entry point")
def test_run_sh_installs_the_carried_wheels_then_runs_the_check(tmp_path):
    package = tmp_path / "pkg"
    (package / "conveyor_probe").mkdir(parents=True)
    (package / "conveyor_probe" / "__init__.py").write_text("VALUE = 42\n")
    (package / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "conveyor-probe"\nversion = "1.0"\n'
    )
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    subprocess.run(
        [*build, str(package)],
        check=True,
        timeout=300,
    )
    site, out = tmp_path / "site", tmp_path / "out"
    env = dict(_env(), GPU_PY=sys.executable, CONVEYOR_WHEELS=str(wheels), CONVEYOR_SITE=str(site))
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check/run.sh", str(out), "--dry-run", "--only", "moe", "--work", str(tmp_path / "w")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert (site / "conveyor_probe" / "__init__.py").exists()
    summary = json.loads((out / SUMMARY).read_text())
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [("moe", "ok")]
