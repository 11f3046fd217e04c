"""Progress while a queued job runs: ``conveyor status`` (and ``--json``) shows requests done, the
rate over the last minute, the time left (once enough lines finished; until then what it waits
for) and the tokens so far before the job ends, and ``conveyor results --follow`` reports
progress on stderr while writing its target file."""

from __future__ import annotations

import json
import queue
import re
import subprocess
import threading
import time
from pathlib import Path

from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.progress_bar import WindowRate, duration
from tests.worker.helpers import ENGINE, PYTHON, REPO

ITEMS = 60
SHARD = 30
MAX_TOKENS = "256"  # ignoring EOS: a line takes a fraction of a second, the job many


def _rows(path: Path) -> None:
    # ignore_eos: every request runs its max_tokens, so the job lasts long enough to watch.
    lines = [json.dumps({"id": f"r{i}", "prompt": f"Describe product {i}", "ignore_eos": True}) for i in range(ITEMS)]
    path.write_text("\n".join(lines) + "\n")


def _stderr_lines(proc: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def test_status_and_follow_report_progress_while_a_queued_job_runs(
    embedded_stack, env, spawn_worker, tmp_path, capsys
) -> None:
    # One request at a time in the engine and one shard at a time in the worker: the shards
    # finish one after the other, seconds apart.
    stack = env(embedded_stack, engine_args={**ENGINE, "max_num_seqs": 1})
    worker = spawn_worker(embedded_stack, concurrency=1, engine_args={**ENGINE, "max_num_seqs": 1})
    worker.wait_ready(120)
    path, out = tmp_path / "rows.jsonl", tmp_path / "follow.jsonl"
    _rows(path)
    argv = [
        "submit",
        str(path),
        "--model",
        stack.model,
        "--json",
        "--shard-size",
        str(SHARD),
        "--max-tokens",
        MAX_TOKENS,
    ]
    assert main(argv) == 0
    job_id = json.loads(capsys.readouterr().out)["id"]
    follow = subprocess.Popen(
        [PYTHON, "-m", "conveyor.worker.entrypoints.cli", "results", job_id, "--follow", "-o", str(out)],
        cwd=REPO, env=stack.env(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # status --json, before the job ends: done, rate, ETA (once 20 lines finished) and tokens so far.
        deadline = time.monotonic() + 120
        notes = []
        while True:
            assert time.monotonic() < deadline, worker.log()[-3000:]
            assert main(["status", job_id, "--json"]) == 0
            job = json.loads(capsys.readouterr().out)
            p = job["progress"]
            if p is not None and p["eta_seconds"] is None and p["done"]:
                notes.append((p["done"], p["eta_note"]))
            if p is not None and p["eta_seconds"] is not None:
                break
            time.sleep(0.2)
        assert notes and all(note for _done, note in notes), notes
        assert all(done >= 20 or note.startswith("after 20 lines finish") for done, note in notes), notes
        assert p["done"] >= 20
        assert job["status"] == "in_progress" and p["done"] < p["total"] == ITEMS
        assert p["requests_per_second"] > 0 and p["eta_seconds"] > 0 and 1.0 <= p["window_seconds"] <= 60.0
        at_that_rate = p["remaining"] / p["requests_per_second"]  # the rate shown is rounded to 3 places
        assert abs(p["eta_seconds"] - at_that_rate) <= 0.01 * at_that_rate + 0.1
        assert p["output_tokens"] >= int(MAX_TOKENS) * job["request_counts"]["completed"] > 0
        assert job["usage"]["output_tokens"] == p["output_tokens"] and job["usage"]["input_tokens"] > 0
        assert p["output_tokens_per_second"] > 0
        # The human line says the same.
        assert main(["status", job_id]) == 0
        line = capsys.readouterr().out
        assert "in_progress" in line and "req/s" in line and "ETA" in line and "output tokens so far" in line

        # results --follow: progress on stderr while the job runs, as the file grows.
        lines = _stderr_lines(follow)
        reports = []
        while True:
            text = lines.get(timeout=120)
            if text is None:
                break
            if "lines written" in text:
                reports.append(text)
        assert follow.wait(timeout=60) == 0
    finally:
        if follow.poll() is None:
            follow.kill()
    assert reports, "no progress reported while the job ran"
    found = re.search(r"(\d+) lines written; (\d+)/(\d+) done", reports[0])
    assert found is not None, reports[0]
    written, done, total = (int(x) for x in found.groups())
    assert int(total) == ITEMS and written <= done < ITEMS  # reported before the job's items were all stored
    assert "ETA" in reports[0] and "output tokens so far" in reports[0]
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(ITEMS)]
    assert not Path(f"{out}.partial").exists()


def test_the_run_bar_rate_is_over_a_window_not_per_update() -> None:
    now = [0.0]
    rate = WindowRate(window=60.0, clock=lambda: now[0])
    assert rate.rates() is None  # under a second: no rate yet
    for t in range(1, 31):  # a burst of 10 every 10 s for 30 s... then silence
        now[0] = float(t)
        if t % 10 == 0:
            rate.add(10, 100)
    assert rate.rates() == (1.0, 10.0)  # 30 requests over 30 s
    now[0] = 75.0
    assert rate.rates() == (20 / 60, 200 / 60)  # the first burst (t=10) left the window [15, 75]
    now[0] = 200.0
    assert rate.rates() == (0.0, 0.0)
    assert (duration(7), duration(125), duration(3723)) == ("0:07", "2:05", "1:02:03")


def test_jobs_and_status_name_the_database_when_they_find_nothing(embedded_stack, env, capsys) -> None:
    stack = env(embedded_stack)
    assert main(["jobs"]) == 0
    err = capsys.readouterr().err
    assert "no jobs in the database sqlite:///" in err and str(stack.settings.home_dir) in err
    assert main(["status", "batch_" + "0" * 32]) == 1
    err = capsys.readouterr().err
    assert "no job batch_" in err and "in the database sqlite:///" in err and "CONVEYOR_HOME" in err
