"""torch's intra-op threads sized from what the process may use: affinity, cgroup CPU quota
(v2 ``cpu.max`` and v1 ``cpu.cfs_quota_us``, nested), OMP_NUM_THREADS, an explicit count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conveyor.engine import EngineConfig
from conveyor.engine.runner.cpu_threads import (
    AFFINITY,
    ENVIRONMENT,
    EXPLICIT,
    QUOTA,
    cgroup_cpu_quota,
    check_cpu_threads,
    cpu_budget,
)

REPO = Path(__file__).resolve().parents[2]


def _v2(tmp_path: Path, own: str, limits: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup v2 filesystem under tmp_path with ``cpu.max`` files, and a /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    for path, value in limits.items():
        d = root / path.strip("/") if path.strip("/") else root
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(value + "\n")
    (root / own.strip("/")).mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})


def test_a_kubernetes_cpu_limit_rounds_down(tmp_path, four_cpus):
    root, proc = _v2(tmp_path, "/kubepods/pod1/ctr", {"/kubepods/pod1/ctr": "150000 100000"})
    assert cgroup_cpu_quota(root, proc) == 1.5
    budget = cpu_budget(environ={}, root=root, proc_cgroup=proc)
    assert (budget.threads, budget.source, budget.affinity, budget.quota) == (1, QUOTA, 4, 1.5)
    assert budget.derived
    assert "1 torch threads" in budget.describe() and "quota 1.5" in budget.describe()


def test_the_tightest_ancestor_wins_and_max_means_none(tmp_path, four_cpus):
    root, proc = _v2(tmp_path, "/a/b/c", {"/a": "200000 100000", "/a/b": "max 100000", "/a/b/c": "300000 100000"})
    assert cgroup_cpu_quota(root, proc) == 2.0
    assert cpu_budget(environ={}, root=root, proc_cgroup=proc).threads == 2


def test_no_quota_leaves_the_affinity(tmp_path, four_cpus):
    root, proc = _v2(tmp_path, "/user.slice", {"/user.slice": "max 100000"})
    budget = cpu_budget(environ={}, root=root, proc_cgroup=proc)
    assert (budget.threads, budget.source, budget.quota) == (4, AFFINITY, None)
    # A quota above the affinity changes nothing either.
    root, proc = _v2(tmp_path / "big", "/x", {"/x": "800000 100000"})
    assert cpu_budget(environ={}, root=root, proc_cgroup=proc).source == AFFINITY


def test_a_container_sees_its_own_cgroup_at_the_mount_root(tmp_path, four_cpus):
    """With a cgroup namespace /proc names the host's path, absent under the container's mount."""
    root, proc = _v2(tmp_path, "/", {"/": "100000 100000"})
    proc.write_text("0::/kubepods.slice/not/mounted/here\n")
    assert cgroup_cpu_quota(root, proc) == 1.0


def test_cgroup_v1_cfs_quota(tmp_path, four_cpus):
    d = tmp_path / "cgroup" / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("250000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    budget = cpu_budget(environ={}, root=tmp_path / "cgroup", proc_cgroup=proc)
    assert (budget.threads, budget.quota) == (2, 2.5)
    (d / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert cgroup_cpu_quota(tmp_path / "cgroup", proc) is None


def test_no_cgroup_filesystem_is_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path / "none", tmp_path / "no-proc-file") is None


def test_explicit_beats_environment_beats_machine(tmp_path, four_cpus):
    root, proc = _v2(tmp_path, "/x", {"/x": "100000 100000"})
    env = {"OMP_NUM_THREADS": "3"}
    explicit = cpu_budget(6, environ=env, root=root, proc_cgroup=proc)
    assert (explicit.threads, explicit.source, explicit.derived) == (6, EXPLICIT, False)
    from_env = cpu_budget(environ=env, root=root, proc_cgroup=proc)
    assert (from_env.threads, from_env.source, from_env.derived) == (3, ENVIRONMENT, False)


@pytest.mark.parametrize("bad", [0, -1, 1025, True, "2", 1.5])
def test_a_bad_count_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="cpu_threads must be an integer from 1 to 1024"):
        check_cpu_threads(bad)
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(model="org/model", cpu_threads=bad)


def test_a_process_pinned_to_one_cpu_gets_one_thread():
    """The real thing: affinity set by the process (as taskset or a cpuset would), torch sized to it."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "import torch; from conveyor.engine.runner.cpu_threads import apply_cpu_budget, cpu_budget; "
        "b = cpu_budget(); apply_cpu_budget(b); print(b.threads, b.source, torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[:1] + out.stdout.split()[-1:] == ["1", "1"], out.stdout
    assert AFFINITY in out.stdout or QUOTA in out.stdout


def test_the_engine_cli_takes_and_logs_the_count(tiny_models, tmp_path, capsys):
    from conveyor.engine.__main__ import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n")
    before = torch.get_num_threads()
    try:
        model = tiny_models("llama")
        assert main(["--model", model, "--prompts", str(prompts), "--max-tokens", "2", "--cpu-threads", "1"]) == 0
        assert "engine: 1 torch threads (cpu_threads;" in capsys.readouterr().err
        assert main(["--model", model, "--prompts", str(prompts), "--cpu-threads", "0"]) == 2
        assert "cpu_threads must be an integer from 1 to 1024" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
