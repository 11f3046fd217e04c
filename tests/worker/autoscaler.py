"""A real Prometheus server and a small autoscaler that follows KEDA's rules, for the system test
of scaling from zero (``test_autoscaling.py``).

The autoscaler reads its trigger (query, ``threshold``, ``activationThreshold``), its polling
interval, cooldown, replica bounds and the HPA's scale-down behaviour from the manifests in
``infra/k8s`` (the ScaledObject of the base, the ScaledJob of ``overlays/gpu-jobs``), and the
workers' command line (``--drain-timeout``, ``--exit-when-idle``) and concurrency from the same
place, so the manifests and the test cannot drift. Every duration is multiplied by
``time_scale`` (a test cannot wait KEDA's five-minute cooldown), but for the part of
``terminationGracePeriodSeconds`` beyond the drain timeout: that margin is for a process to
exit, which no time scale makes faster. The rules stay KEDA's:

- ScaledObject: each polling interval the query is evaluated through Prometheus' HTTP API. An
  empty result or an error holds the replica count (``ignoreNullValues: "false"``). Above the
  activation threshold at zero, KEDA starts one worker; the HPA then wants
  ``ceil(value / threshold)`` (at least 1, at most ``maxReplicaCount``; no change within its 10%
  tolerance), scales up at once, and scales down to the highest count it wanted over the
  stabilization window, at most one pod per policy period, the newest pod first (as a
  ReplicaSet picks, after any not ready). After ``cooldownPeriod`` with the trigger inactive,
  KEDA scales to zero. A pod is stopped as Kubernetes deletes one: SIGTERM, then SIGKILL after
  ``terminationGracePeriodSeconds``.
- ScaledJob (``scalingStrategy: default``): each polling interval it starts
  ``min(maxReplicaCount, ceil(value / threshold)) - running jobs`` new workers (none below the
  activation threshold) and never stops one: each exits by itself (``--exit-when-idle``).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.worker.helpers import REPO, WorkerProc, _die_with_parent

K8S = REPO / "infra" / "k8s"
SCALED_OBJECT = K8S / "base" / "worker-scaledobject.yaml"
SCALED_JOB = K8S / "overlays" / "gpu-jobs" / "worker-scaledjob.yaml"
WORKER = K8S / "base" / "worker.yaml"
CONFIG = K8S / "base" / "config.yaml"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _flag(args: list[str], flag: str) -> float:
    return float(args[args.index(flag) + 1])


@dataclass(frozen=True)
class Trigger:
    """What a KEDA object scales on, and how fast, from its manifest (durations scaled)."""

    query: str
    threshold: float
    activation: float
    polling_s: float
    max_replicas: int
    cooldown_s: float = 0.0  # ScaledObject: inactive this long -> 0
    stabilization_s: float = 0.0  # HPA scale-down: the highest wish over this window
    pods_per_period: int = 1  # HPA scale-down policy
    period_s: float = 0.0
    grace_s: float = 0.0  # terminationGracePeriodSeconds
    drain_s: float = 0.0  # the workers' --drain-timeout
    idle_s: float | None = None  # the workers' --exit-when-idle (ScaledJob)
    concurrency: int = 4  # CONVEYOR_WORKER_CONCURRENCY (= threshold, as tests/infra checks)
    model: str = ""  # the model the manifests name (in the query and the worker's --model)

    def for_model(self, model: str) -> str:
        """The query with the test's model in place of the manifests' one."""
        return self.query.replace(f'model="{self.model}"', f'model="{model}"')


def _model_of(query: str) -> str:
    models = set(re.findall(r'model="([^"]*)"', query))
    assert len(models) == 1, f"the trigger's query names {models}, not one model"
    return models.pop()


def _common(spec: dict[str, Any], pod: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """What a ScaledObject and a ScaledJob share: the trigger, polling, bounds, the pod's stop.
    The grace period is the drain timeout scaled plus its margin over it as it is."""
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    args = pod["containers"][0]["args"]
    drain = _flag(args, "--drain-timeout")
    return {
        "query": meta["query"],
        "threshold": float(meta["threshold"]),
        "activation": float(meta.get("activationThreshold", 0)),
        "polling_s": spec.get("pollingInterval", 30) * time_scale,
        "max_replicas": int(spec["maxReplicaCount"]),
        "grace_s": drain * time_scale + (float(pod["terminationGracePeriodSeconds"]) - drain),
        "drain_s": drain * time_scale,
        "concurrency": int(_docs(CONFIG)[0]["data"]["CONVEYOR_WORKER_CONCURRENCY"]),
        "model": _model_of(meta["query"]),
    }


def scaled_object_trigger(time_scale: float) -> Trigger:
    [so] = _docs(SCALED_OBJECT)
    spec = so["spec"]
    deployment = next(d for d in _docs(WORKER) if d["kind"] == "Deployment")
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    [policy] = behavior["policies"]
    assert policy["type"] == "Pods"
    return Trigger(
        **_common(spec, deployment["spec"]["template"]["spec"], time_scale),
        cooldown_s=spec.get("cooldownPeriod", 300) * time_scale,
        stabilization_s=behavior["stabilizationWindowSeconds"] * time_scale,
        pods_per_period=int(policy["value"]),
        period_s=policy["periodSeconds"] * time_scale,
    )


def scaled_job_trigger(time_scale: float) -> Trigger:
    [sj] = _docs(SCALED_JOB)
    spec = sj["spec"]
    assert spec["scalingStrategy"]["strategy"] == "default"
    pod = spec["jobTargetRef"]["template"]["spec"]
    return Trigger(
        **_common(spec, pod, time_scale),
        idle_s=_flag(pod["containers"][0]["args"], "--exit-when-idle") * time_scale,
    )


# ---- Prometheus ---------------------------------------------------------------------------


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class Prometheus:
    """A Prometheus server of its own (config, data directory, port) scraping ``targets``."""

    def __init__(self, binary: str, workdir: Path, targets: list[str], port: int, scrape_s: float = 1.0) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {
                "scrape_interval": f"{round(scrape_s * 1000)}ms",
                "scrape_timeout": f"{round(scrape_s * 1000)}ms",
            },
            "scrape_configs": [
                {"job_name": "conveyor", "metrics_path": "/metrics", "static_configs": [{"targets": targets}]}
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115
        argv = [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}: {self.log()[-2000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready after {timeout} s: {self.log()[-2000:]}")

    def log(self) -> str:
        return (Path(self._log.name)).read_text(errors="replace")

    def query(self, expr: str) -> float | None:
        """The instant value of ``expr`` (one sample expected); None for an empty result."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            data = json.loads(resp.read())
        assert data["status"] == "success", data
        result = data["data"]["result"]
        if not result:
            return None
        assert len(result) == 1, f"{expr!r} gave {len(result)} series: {result}"
        return float(result[0]["value"][1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# ---- the autoscaler -------------------------------------------------------------------------


@dataclass
class Pod:
    """One worker process, as a pod: when it was started, became ready, was told to stop, ended."""

    proc: WorkerProc
    started_at: float  # time.time()
    args: tuple[str, ...] = ()  # what the autoscaler added to the worker's command line
    ready_at: float | None = None
    terminated_at: float | None = None  # SIGTERM sent
    killed: bool = False  # SIGKILL after the grace period
    exited_at: float | None = None
    returncode: int | None = None

    @property
    def alive(self) -> bool:
        return self.exited_at is None


@dataclass
class Autoscaler:
    """Runs on a thread of its own: ``start()``, ``stop()``. ``jobs``: the ScaledJob's rules,
    else the ScaledObject's. ``spawn(args)`` starts one worker process with these extra args."""

    prometheus: Prometheus
    trigger: Trigger
    model: str
    spawn: Any  # Callable[[tuple[str, ...]], WorkerProc]
    jobs: bool = False
    pods: list[Pod] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    values: list[tuple[float, float | None]] = field(default_factory=list)  # (time, query value)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Autoscaler:
        self._last_active = -math.inf
        self._last_scale_down = -math.inf
        self._wishes: list[tuple[float, int]] = []
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for pod in self.live():
            self._terminate(pod)
        deadline = time.monotonic() + max(10.0, self.trigger.grace_s)
        while self.live() and time.monotonic() < deadline:
            self._observe()
            time.sleep(0.1)
        for pod in self.pods:
            pod.proc.stop()

    def live(self) -> list[Pod]:
        return [p for p in self.pods if p.alive]

    def first_started_after(self, t: float) -> Pod | None:
        return next((p for p in self.pods if p.started_at >= t), None)

    # ---- one tick ---------------------------------------------------------------------

    def _run(self) -> None:
        query = self.trigger.for_model(self.model)
        while not self._stop.wait(self.trigger.polling_s):
            self._observe()
            try:
                value = self.prometheus.query(query)
            except Exception as exc:  # a scaler error holds the count, as in KEDA
                self.errors.append(f"{type(exc).__name__}: {exc}")
                value = None
            self.values.append((time.time(), value))
            if value is None:
                continue
            if self.jobs:
                self._scale_jobs(value)
            else:
                self._scale_deployment(value)

    def _observe(self) -> None:
        now = time.time()
        for pod in self.pods:
            if pod.ready_at is None and " ready." in pod.proc.log():
                pod.ready_at = now
            if pod.alive and pod.proc.proc.poll() is not None:
                pod.exited_at, pod.returncode = now, pod.proc.proc.returncode
            if pod.alive and pod.terminated_at is not None and now - pod.terminated_at > self.trigger.grace_s:
                pod.killed = True  # Kubernetes' SIGKILL at the end of the grace period
                pod.proc.kill9()

    def _wanted(self, value: float) -> int:
        return min(self.trigger.max_replicas, math.ceil(value / self.trigger.threshold))

    def _scale_jobs(self, value: float) -> None:
        wanted = self._wanted(value) if value > self.trigger.activation else 0
        for _ in range(wanted - len(self.live())):
            self._launch()

    def _scale_deployment(self, value: float) -> None:
        now = time.monotonic()
        replicas = len([p for p in self.live() if p.terminated_at is None])
        if value > self.trigger.activation:
            self._last_active = now
        if replicas == 0:
            if value > self.trigger.activation:
                self._launch()  # KEDA's activation: 0 -> 1
            return
        if value <= self.trigger.activation and now - self._last_active >= self.trigger.cooldown_s:
            for pod in self.live():  # KEDA's deactivation: -> 0 after the cooldown
                self._terminate(pod)
            self._wishes.clear()
            return
        wish = max(1, self._wanted(value))
        if abs(value / (replicas * self.trigger.threshold) - 1.0) <= 0.1:
            wish = replicas  # within the HPA's tolerance
        self._wishes = [(t, w) for t, w in self._wishes if now - t <= self.trigger.stabilization_s]
        self._wishes.append((now, wish))
        if wish > replicas:
            for _ in range(wish - replicas):
                self._launch()
            return
        target = max(w for _, w in self._wishes)
        if target < replicas and now - self._last_scale_down >= self.trigger.period_s:
            running = [p for p in self.live() if p.terminated_at is None]
            # A ReplicaSet deletes pods that are not ready first, then the newest.
            order = sorted(running, key=lambda p: (p.ready_at is not None, -p.started_at))
            for pod in order[: min(self.trigger.pods_per_period, replicas - target)]:
                self._terminate(pod)
            self._last_scale_down = now

    def _launch(self) -> None:
        args = ["--drain-timeout", f"{self.trigger.drain_s:g}"]
        if self.jobs and self.trigger.idle_s is not None:
            args += ["--exit-when-idle", f"{self.trigger.idle_s:g}"]
        self.pods.append(Pod(self.spawn(tuple(args)), time.time(), tuple(args)))

    def _terminate(self, pod: Pod) -> None:
        if pod.terminated_at is None:
            pod.terminated_at = time.time()
            pod.proc.terminate()
