"""The chaos soak in short (``benchmarks/bench_faults.py`` runs it for minutes): a small job on
private PostgreSQL, Redis and S3 instances, workers started by the KEDA-like autoscaler, and one
of each fault in turn while it runs: a worker SIGKILLed, a worker stopped as a spot node is
(SIGTERM, drain, SIGKILL after the grace period), Redis restarted empty, PostgreSQL stopped and
started, the object store refusing connections, the API server killed. The job completes with
every line answered exactly once and none failed by a fault."""

from __future__ import annotations

import shutil

import pytest

from tests.worker.chaos import FAULTS, ChaosDeployment, run_job_under_faults

LINES = 2000
MAX_TOKENS = 16  # with two sequences at a time: slow enough for six faults while it runs
SHARD_SIZE = 25


@pytest.fixture
def deployment(tmp_path, tiny_models):
    for binary in ("redis-server", "initdb", "pg_ctl"):
        if shutil.which(binary) is None:
            pytest.skip(f"SERVICE DOWN: {binary} is not on PATH (the chaos run starts private instances)")
    dep = ChaosDeployment(
        tmp_path,
        tiny_models("llama"),
        max_workers=3,
        concurrency=2,
        engine_args={"num_kv_blocks": 512, "max_num_seqs": 2},
    )
    yield dep
    dep.close()


def test_one_of_each_fault_loses_and_repeats_no_line(deployment) -> None:
    run = run_job_under_faults(
        deployment, LINES, shard_size=SHARD_SIZE, max_tokens=MAX_TOKENS, schedule=list(FAULTS), interval_s=(0.5, 1.0),
        max_outage_s=4.0, timeout_s=240.0,
    )  # fmt: skip
    assert [f.kind for f in run.faults] == list(FAULTS), "the job finished before every fault; make it longer"
    assert all(f.detail != "no ready worker to stop" for f in run.faults), run.as_dict()
    assert run.exactly_once, run.as_dict()
    assert run.shards["failures"] == 0, run.shards
