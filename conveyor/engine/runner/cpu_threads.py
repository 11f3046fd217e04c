"""How many threads torch's CPU operators may use: the CPUs this process may really run on.

torch sizes its intra-op pool from the machine's cores, not from what a container or a
scheduler grants the process. Two limits apply, and the smaller wins:

- CPU affinity (``sched_getaffinity``: a cpuset, ``taskset``, Kubernetes' static CPU manager);
- the CFS quota of the process's cgroup and its ancestors (``cpu.max`` in cgroup v2,
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1: a Kubernetes CPU limit), rounded down
  (at least 1): threads beyond the quota run out of it together before each period ends and
  are all stopped until the next, which stalls every parallel region in the step.

An explicit count (``EngineConfig.cpu_threads``: ``--cpu-threads``, ``CONVEYOR_CPU_THREADS``)
wins, then ``OMP_NUM_THREADS`` from the environment (as torch itself honours it). Only the
derived count is a ceiling the engine may tune under (``conveyor.engine.runner.thread_tuner``); an explicit
one is used as given.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_CPU_THREADS = 1024
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")

EXPLICIT = "cpu_threads"
ENVIRONMENT = "OMP_NUM_THREADS"
AFFINITY = "affinity"
QUOTA = "cgroup cpu quota"


@dataclass(frozen=True)
class CpuBudget:
    """The intra-op threads to use, and what decided it."""

    threads: int
    source: str  # EXPLICIT, ENVIRONMENT, AFFINITY or QUOTA
    affinity: int  # CPUs the process may run on
    quota: float | None  # CPUs' worth of time the cgroup grants per period; None: unlimited

    @property
    def derived(self) -> bool:
        """Whether the count came from the machine (a ceiling to tune under), not from a person."""
        return self.source in (AFFINITY, QUOTA)

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup CPU quota {self.quota:g}"
        return f"{self.threads} torch threads ({self.source}; {self.affinity} CPUs in affinity, {quota})"


def check_cpu_threads(value: object, name: str = "cpu_threads") -> int | None:
    """``value`` if it is None or a thread count from 1 to ``MAX_CPU_THREADS``; else ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CPU_THREADS:
        raise ValueError(f"{name} must be an integer from 1 to {MAX_CPU_THREADS} (or unset), got {value!r}")
    return value


def affinity_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def _read_quota_v2(path: Path) -> float | None:
    """``cpu.max`` ("max 100000" or "150000 100000") as CPUs; None: unlimited or unreadable."""
    try:
        fields = path.read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read_quota_v1(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _own_cgroups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup path in the v2 hierarchy and in v1's ``cpu`` controller."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _lineage(mount: Path, cgroup_path: str) -> list[Path]:
    """The cgroup's directory under ``mount`` and its ancestors up to the mount (limits nest).
    Inside a container the mount's root often is the process's own cgroup, whatever path
    /proc names: the mount's root is always looked at."""
    parts = [p for p in cgroup_path.split("/") if p]
    dirs = [mount.joinpath(*parts[:i]) for i in range(len(parts), 0, -1)]
    return [*dirs, mount]


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The smallest CFS quota over this process's cgroup and its ancestors, in CPUs (None:
    no quota, or no cgroup filesystem to read)."""
    v2, v1 = _own_cgroups(proc_cgroup)
    quotas: list[float] = []
    if v2 is not None:
        for mount in (root, root / "unified"):
            quotas += [q for d in _lineage(mount, v2) if (q := _read_quota_v2(d / "cpu.max")) is not None]
    if v1 is not None:
        for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
            quotas += [q for d in _lineage(mount, v1) if (q := _read_quota_v1(d)) is not None]
    return min(quotas) if quotas else None


def cpu_budget(
    explicit: int | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_CGROUP,
) -> CpuBudget:
    """The intra-op thread count for this process (see the module docstring)."""
    explicit = check_cpu_threads(explicit)
    env = os.environ if environ is None else environ
    affinity = affinity_cpus()
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if explicit is not None:
        return CpuBudget(explicit, EXPLICIT, affinity, quota)
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return CpuBudget(min(int(omp), MAX_CPU_THREADS), ENVIRONMENT, affinity, quota)
    if quota is not None and math.floor(quota) < affinity:
        return CpuBudget(max(1, math.floor(quota)), QUOTA, affinity, quota)
    return CpuBudget(affinity, AFFINITY, affinity, quota)


def apply_cpu_budget(budget: CpuBudget) -> None:
    """Size torch's intra-op pool (process-wide; a thread that has not run a parallel
    operator yet takes this count when it first does)."""
    if torch.get_num_threads() != budget.threads:
        torch.set_num_threads(budget.threads)
