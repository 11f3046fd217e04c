"""A job of many short lines (1,000,000 by default) end to end on private PostgreSQL, Redis and S3
(moto) instances with a trivial engine (the engine is not what is measured): through ``conveyor
submit`` or the Files API upload (``--door``), with ``conveyor results --follow -o`` writing the
results as they come from the start, then ``conveyor results -o`` once the job has ended.

Reported per run: the time of each phase (submit, intake, run, finalisation, results download;
intake, run and finalisation from the job's own timestamps) and the peak resident memory of the
submitting process, the API server, each worker (the finaliser is the worker that runs the last
shard's finalisation), the follower and the results download, sampled every 0.2 s from /proc,
children included. Job-path speed: lines over the run phase, for each worker count in ``--workers``.

    PYTHONPATH=. python benchmarks/bench_million.py --lines 100000 --workers 1,2
    PYTHONPATH=. python benchmarks/bench_million.py --lines 1000000 --workers 1 --door files

Writes ``benchmarks/results/million.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from benchmarks.common import bench_model, write_results
from conveyor.worker.store.models import Item, Job
from tests.worker.chaos import MODEL, ChaosDeployment, job_lines
from tests.worker.helpers import PYTHON, REPO


def _tree_rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants (KiB), from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                with contextlib.suppress(OSError, ValueError):
                    rss += _tree_rss_kib(int(child))
    return rss


class PeakRss:
    """The peak resident memory (MiB) of named processes and their children, sampled on a thread."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.pids: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for name, pid in list(self.pids.items()):
                with contextlib.suppress(OSError, ValueError):
                    self.peaks[name] = max(self.peaks.get(name, 0.0), _tree_rss_kib(pid) / 1024)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        return {name: round(mib, 1) for name, mib in sorted(self.peaks.items())}


def _timed(argv: list[str], env: dict[str, str], rss: PeakRss, name: str) -> tuple[float, str]:
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rss.watch(name, proc.pid)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[3:5]} exited {proc.returncode}: {err.decode()[-2000:]}")
    return time.monotonic() - start, out.decode()


def _submit_files_api(dep: ChaosDeployment, path: Path) -> str:
    """Upload through the API server's Files API with the official SDK, then create the batch."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{dep.api_port}/v1", api_key=dep.api_key, timeout=3600)
    with open(path, "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    return batch.id


def trivial_model(hidden_size: int = 32, num_layers: int = 1) -> Path:
    """One layer of width 32: a step of 128 short prompts costs the engine about a millisecond,
    so what is measured is the job path (intake, leases, tokenizing, item writes, parts,
    finalisation), not matrix products. (The 4-layer bench model made the engine 60% of a
    worker's CPU at 20,000 lines.)"""
    name = (
        "conveyor-trivial-llama"
        if (hidden_size, num_layers) == (32, 1)
        else f"conveyor-llama-{hidden_size}x{num_layers}"
    )
    return bench_model(
        name,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=2 * hidden_size,
    )


def one_run(model: str, lines: int, workers: int, door: str, shard_size: int, concurrency: int = 2) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="conveyor-million-") as tmp:
        workdir = Path(tmp)
        dep = ChaosDeployment(
            workdir, model, max_workers=workers, concurrency=concurrency,
            engine_args={"num_kv_blocks": 1024, "max_num_seqs": 128},
            lease_seconds=30.0, heartbeat_seconds=5.0, sweep_interval_seconds=10.0,
            shard_size=shard_size,  # the Files API door's (the deployment's default); the CLI passes its own
        )  # fmt: skip
        rss = PeakRss()
        rss.watch("api_server", dep.api.pid if dep.api else 0)
        try:
            path = workdir / "input.jsonl"
            with open(path, "w") as f:
                for line in job_lines(lines, max_tokens=1):
                    line["body"]["model"] = MODEL  # the Files API door takes the model from the lines
                    f.write(json.dumps(line) + "\n")
            dep.autoscaler.start()
            env = dep.stack.env()
            cli = [PYTHON, "-m", "conveyor.worker.entrypoints.cli"]
            t_submit = time.monotonic()
            if door == "cli":
                argv = [*cli, "submit", str(path), "--model", MODEL, "--shard-size", str(shard_size), "--json"]
                submit_s, out = _timed(argv, env, rss, "submitter")
                job_id = json.loads(out)["id"]
            else:
                rss.watch("submitter", os.getpid())  # the SDK runs in this process
                job_id = _submit_files_api(dep, path)
                submit_s = time.monotonic() - t_submit
            # ``conveyor results --follow`` from the start: it writes each shard's lines as the
            # shard finishes and exits when the job ends (its peak memory is reported too).
            follower = subprocess.Popen(
                [*cli, "results", job_id, "--follow", "-o", str(workdir / "follow.jsonl")],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            rss.watch("results_follow", follower.pid)
            while True:
                for pod in dep.autoscaler.pods:
                    rss.watch(f"worker_{dep.autoscaler.pods.index(pod)}", pod.proc.pid)
                with dep.db.connect() as conn:
                    job = conn.execute(
                        select(
                            Job.status, Job.created_at, Job.in_progress_at, Job.finalizing_at, Job.completed_at
                        ).where(Job.id == job_id)
                    ).one()
                if str(job.status) in ("completed", "failed", "JobStatus.completed", "JobStatus.failed"):
                    break
                time.sleep(0.5)
            with dep.db.connect() as conn:
                first, last = conn.execute(
                    select(func.min(Item.finished_at), func.max(Item.finished_at)).where(Item.job_id == job_id)
                ).one()
            _, follow_err = follower.communicate(timeout=600)
            if follower.returncode != 0:
                raise RuntimeError(f"results --follow exited {follower.returncode}: {follow_err.decode()[-2000:]}")
            with open(workdir / "follow.jsonl", "rb") as f:
                followed = sum(1 for _ in f)
            results_s, _ = _timed([*cli, "results", job_id, "-o", str(workdir / "out.jsonl")], env, rss, "results")
            with open(workdir / "out.jsonl", "rb") as f:
                answered = sum(1 for _ in f)
            peaks = rss.stop()
            started = job.in_progress_at or job.created_at
            run_s = (job.finalizing_at or job.completed_at or started) - started
            return {
                "lines": lines, "workers": workers, "door": door, "status": str(job.status),
                "answered": answered, "answered_by_follow": followed,
                "phases_s": {
                    "submit": round(submit_s, 2),
                    "intake": round(started - job.created_at, 2),
                    "run": round(run_s, 2),
                    "finalise": round((job.completed_at or 0) - (job.finalizing_at or job.completed_at or 0), 2),
                    "results_download": round(results_s, 2),
                },
                # first item stored to last: the job path's speed, without the worker's cold start
                "items_per_s": round(lines / (last - first), 1) if last > first else None,
                "run_including_cold_start_items_per_s": round(lines / run_s, 1) if run_s > 0 else None,
                "peak_rss_mib": peaks,
            }  # fmt: skip
        finally:
            rss.stop()
            dep.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    parser.add_argument("--door", choices=("cli", "files"), default="cli")
    parser.add_argument("--shard-size", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=2, help="shard places per worker")
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--out", default="million.json")
    args = parser.parse_args()
    model = str(trivial_model(args.hidden_size, args.num_layers))
    runs = []
    for workers in (int(w) for w in args.workers.split(",")):
        run = one_run(model, args.lines, workers, args.door, args.shard_size, args.concurrency)
        print(json.dumps(run))
        runs.append(run)
    write_results(args.out, {"args": vars(args), "runs": runs, "note": "a shared 2-core machine"})
    return 0 if all(r["answered"] == r["lines"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
