"""infra/k8s: every overlay renders with `kubectl kustomize`, every object validates offline
(Kubernetes' schemas for K8S_VERSION; KEDA's CRDs, checked in), and the properties that make
scale-to-zero safe hold: KEDA scales from 0 on the demand (shards waiting and in flight, jobs
not yet ingested), the catalog declares the workers' models, GPU workers ask for a GPU, probes
hit what the commands serve, a draining worker is never killed early, and no secret value is
committed."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
import yaml

from conveyor.worker.core.catalog import parse_catalog
from tests.infra.contract import (
    DOCKERFILES,
    IMAGES,
    INFRA,
    LIVENESS_PATH,
    READINESS_PATH,
    SERVED,
    Dockerfile,
    Invocation,
    check_invocation,
    parse_quantity,
    pyproject,
    read_dockerfile,
    settings_variables,
)
from tests.infra.keda_schema import K8S_VERSION, object_errors

K8S = INFRA / "k8s"
OVERLAYS = {
    "base": K8S / "base",
    "cpu": K8S / "overlays" / "cpu",
    "cpu-embeddings": K8S / "overlays" / "cpu-embeddings",
    "gpu": K8S / "overlays" / "gpu",
    "gpu-jobs": K8S / "overlays" / "gpu-jobs",
}
DEPLOYABLE = ["cpu", "cpu-embeddings", "gpu", "gpu-jobs"]
SCALED_OBJECT_OVERLAYS = ["base", "cpu", "cpu-embeddings", "gpu"]
GPU_OVERLAYS = ["gpu", "gpu-jobs"]
NAMESPACE = "conveyor"
SECRET_NAME = "conveyor-secrets"  # created by the operator (infra/README.md), never committed
DEMAND = "conveyor_demand"
GPU = "nvidia.com/gpu"
SECRET_LOOKING = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|CREDENTIAL|DATABASE_URL|BROKER_URL", re.IGNORECASE)
URL_WITH_PASSWORD = re.compile(r"\w+://[^/\s:@]*:[^/\s@]+@")
# Non-CONVEYOR variables the ConfigMap may set (S3 endpoint and region, hub settings).
OTHER_CONFIG = re.compile(r"^(AWS_DEFAULT_REGION|AWS_REGION|AWS_ENDPOINT_URL(_S3)?|HF_HUB_\w+|HF_HOME)$")

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (`kubectl kustomize` renders)")


@cache
def _render(name: str) -> str:
    assert KUBECTL is not None
    proc = subprocess.run(
        [KUBECTL, "kustomize", str(OVERLAYS[name])], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"kubectl kustomize {OVERLAYS[name]} failed:\n{proc.stderr}"
    return proc.stdout


def render(name: str) -> list[dict[str, Any]]:
    """The overlay's objects (a fresh copy each call: tests may change them)."""
    return [doc for doc in yaml.safe_load_all(_render(name)) if doc]


def find(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = find(objs, kind)
    assert len(found) == 1, f"expected one {kind}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_templates(objs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(owner, pod template) of every object that runs pods."""
    for o in objs:
        owner = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            yield owner, o["spec"]["template"]
        elif o["kind"] == "ScaledJob":
            yield owner, o["spec"]["jobTargetRef"]["template"]


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def worker_pods(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any], Invocation]]:
    """(owner, pod template, worker container, its command line) for every worker pod."""
    out = []
    for owner, template in pod_templates(objs):
        for c in containers(template):
            if c.get("args", [None])[0] == "worker":
                out.append((owner, template, c, check_invocation(c["args"])))
    return out


def container_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"container {container['name']} has no port named {port!r}"
    return int(named[port])


def config(objs: list[dict[str, Any]]) -> dict[str, str]:
    return dict(one(objs, "ConfigMap").get("data", {}))


def metric_selectors(query: str) -> dict[str, dict[str, str]]:
    """metric name -> its label matchers, for every ``conveyor_*`` metric in a PromQL query."""
    names = set(re.findall(r"\b(conveyor_\w+)", query))
    out: dict[str, dict[str, str]] = {}
    for name in names:
        found = re.findall(rf"\b{name}\{{([^}}]*)\}}", query)
        assert found, f"{name} has no label selector in {query!r}: it would count every model"
        for labels in found:
            matchers = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', labels))
            assert out.get(name, matchers) == matchers, f"{name} selected two ways in {query!r}"
            out[name] = matchers
    return out


# ---- rendering and validation --------------------------------------------------------------


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_overlay_renders_namespaced_objects(overlay):
    objs = render(overlay)
    assert objs, f"{overlay} renders nothing"
    for o in objs:
        assert o.get("apiVersion") and o.get("kind") and o.get("metadata", {}).get("name"), o
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == NAMESPACE, f"{o['kind']}/{o['metadata']['name']}"
    assert one(objs, "Namespace")["metadata"]["name"] == NAMESPACE


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_every_object_validates_offline(overlay):
    """Kubernetes objects against the Kubernetes schemas of K8S_VERSION (strict: an unknown
    field fails), KEDA objects against KEDA's CRD schemas (tests/infra/data/keda)."""
    errors = {f"{o['kind']}/{o['metadata']['name']}": object_errors(o) for o in render(overlay)}
    assert not {k: v for k, v in errors.items() if v}, f"invalid against Kubernetes {K8S_VERSION} / KEDA CRDs"


def test_validation_rejects_broken_objects():
    """The validators are not vacuous: one broken field in each kind of object fails."""
    gpu, jobs = render("gpu"), render("gpu-jobs")
    scaled_object = one(gpu, "ScaledObject")
    scaled_job = one(jobs, "ScaledJob")
    deployment = next(o for o in gpu if o["kind"] == "Deployment")

    def broken(obj: dict[str, Any], change) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        change(obj)
        return obj

    cases = {
        "ScaledObject: unknown field": broken(scaled_object, lambda o: o["spec"].update(minReplicas=0)),
        "ScaledObject: min > max (CEL rule)": broken(scaled_object, lambda o: o["spec"].update(minReplicaCount=99)),
        "ScaledObject: non-string trigger metadata": broken(
            scaled_object, lambda o: o["spec"]["triggers"][0]["metadata"].update(threshold=4)
        ),
        "ScaledObject: bad metadata": broken(scaled_object, lambda o: o["metadata"].update(label={})),
        "ScaledJob: unknown field in the pod": broken(
            scaled_job, lambda o: o["spec"]["jobTargetRef"]["template"]["spec"]["containers"][0].update(gpus=1)
        ),
        "ScaledJob: no triggers": broken(scaled_job, lambda o: o["spec"].pop("triggers")),
        "Deployment: unknown field": broken(
            deployment, lambda o: o["spec"]["template"]["spec"]["containers"][0].update(request={})
        ),
    }
    for what, obj in cases.items():
        assert object_errors(obj), f"{what}: validated"


# ---- KEDA ----------------------------------------------------------------------------------


def _trigger_checks(where: str, triggers: list[dict[str, Any]], model: str, concurrency: int) -> None:
    assert len(triggers) == 1, f"{where}: one trigger, on the demand"
    trigger = triggers[0]
    assert trigger["type"] == "prometheus", where
    meta = trigger["metadata"]
    query = meta["query"]
    selectors = metric_selectors(query)
    # The demand: shards waiting and in flight (a queue-length count misses the running ones)
    # and jobs with no shard yet (a batch or a broker submission that no worker has ingested).
    assert set(selectors) == {DEMAND}, f"{where}: {query!r} must read {DEMAND}, what every door's work adds to"
    for name, labels in selectors.items():
        assert labels == {"model": model}, f"{where}: {name} must select the workers' model {model!r}, not {labels}"
    # Every scrape target (each worker, the API) reports the same database: max, not sum.
    assert query.lstrip().startswith("max("), f"{where}: {query!r} must take max across targets"
    # An empty result (the database unreadable) must be an error (hold), not 0 (scale away).
    assert meta.get("ignoreNullValues") == "false", where
    assert float(meta["threshold"]) == concurrency, f"{where}: threshold must be the shards one worker runs at once"
    assert float(meta.get("activationThreshold", "0")) == 0, f"{where}: one waiting shard must wake a worker"


def _concurrency(objs: list[dict[str, Any]], inv: Invocation) -> int:
    if "--concurrency" in inv.options:
        return int(inv.value("--concurrency"))
    return int(config(objs).get("CONVEYOR_WORKER_CONCURRENCY", 4))


@pytest.mark.parametrize("overlay", SCALED_OBJECT_OVERLAYS)
def test_scaled_object_scales_workers_from_zero_on_in_flight_aware_count(overlay):
    objs = render(overlay)
    so = one(objs, "ScaledObject")
    spec = so["spec"]
    assert spec["minReplicaCount"] == 0
    assert spec["maxReplicaCount"] >= 1
    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    deployment = next(o for o in find(objs, "Deployment") if o["metadata"]["name"] == target["name"])
    workers = worker_pods([deployment])
    assert len(workers) == 1, f"the ScaledObject must scale the worker Deployment, not {target['name']}"
    _owner, _template, _container, inv = workers[0]
    _trigger_checks(f"{overlay}: ScaledObject", spec["triggers"], inv.value("--model"), _concurrency(objs, inv))
    # Scale down gently: at most one worker a minute (each drains what it holds).
    scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert scale_down["stabilizationWindowSeconds"] >= 60
    assert all(p["type"] == "Pods" and p["value"] == 1 for p in scale_down["policies"])


@pytest.mark.parametrize("overlay", DEPLOYABLE)
def test_the_catalog_declares_every_workers_model(overlay):
    """With no worker running, the API accepts work only for declared models and reports their
    demand: a worker whose model is missing from CONVEYOR_MODELS could never be woken by a batch."""
    objs = render(overlay)
    catalog = [m.strip() for m in config(objs).get("CONVEYOR_MODELS", "").split(",") if m.strip()]
    assert parse_catalog(",".join(catalog)) == tuple(catalog), "CONVEYOR_MODELS must parse as the settings do"
    for owner, _template, _c, inv in worker_pods(objs):
        model = inv.options.get("--served-model-name") or inv.value("--model")
        assert model in catalog, f"{overlay}: {owner} serves {model!r}, which CONVEYOR_MODELS ({catalog}) omits"


@pytest.mark.parametrize("overlay", SCALED_OBJECT_OVERLAYS)
def test_keda_owns_the_worker_replica_count(overlay):
    """A `replicas` in the worker Deployment would reset KEDA's count on every apply."""
    for owner, _template, _c, _inv in worker_pods(find(render(overlay), "Deployment")):
        deployment = next(o for o in render(overlay) if f"Deployment/{o['metadata']['name']}" == owner)
        assert "replicas" not in deployment["spec"], owner


def test_scaled_job_runs_workers_to_completion():
    objs = render("gpu-jobs")
    assert not find(objs, "ScaledObject"), "the ScaledJob replaces the ScaledObject"
    assert not worker_pods(find(objs, "Deployment")), "the ScaledJob replaces the worker Deployment"
    assert not [p for p in find(objs, "PodDisruptionBudget") if "worker" in p["metadata"]["name"]]
    sj = one(objs, "ScaledJob")
    spec = sj["spec"]
    assert spec.get("minReplicaCount", 0) == 0
    # The metric counts in-flight shards, which running Jobs hold: "default" subtracts them.
    assert spec["scalingStrategy"]["strategy"] == "default"
    # An update must not delete running Jobs (killing their workers mid-shard).
    assert spec["rollout"]["strategy"] == "gradual"
    [(_owner, template, _c, inv)] = worker_pods([sj])
    assert float(inv.value("--exit-when-idle")) > 0
    assert template["spec"]["restartPolicy"] == "Never"
    assert spec["jobTargetRef"].get("parallelism", 1) == 1 and spec["jobTargetRef"].get("completions", 1) == 1
    _trigger_checks("gpu-jobs: ScaledJob", spec["triggers"], inv.value("--model"), _concurrency(objs, inv))
    # Same scaler as the gpu overlay's ScaledObject.
    assert spec["triggers"] == one(render("gpu"), "ScaledObject")["spec"]["triggers"]


def test_scaled_job_pod_is_the_gpu_worker_pod():
    """The ScaledJob's pod is written out in full (KEDA's jobTargetRef cannot point at the
    Deployment): it must stay the gpu overlay's worker pod but for the run-to-completion bits."""
    [(_o, job_pod, _c, _i)] = worker_pods(find(render("gpu-jobs"), "ScaledJob"))
    [(_o, deploy_pod, _c2, _i2)] = worker_pods(find(render("gpu"), "Deployment"))
    job_pod, deploy_pod = copy.deepcopy(job_pod), copy.deepcopy(deploy_pod)
    job_spec, deploy_spec = job_pod["spec"], deploy_pod["spec"]
    assert job_spec.pop("restartPolicy") == "Never"
    deploy_spec.pop("restartPolicy", None)
    job_args = job_spec["containers"][0].pop("args")
    deploy_args = deploy_spec["containers"][0].pop("args")
    i = job_args.index("--exit-when-idle")
    assert job_args[:i] + job_args[i + 2 :] == deploy_args
    assert job_pod == deploy_pod


# ---- pods ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_every_container_runs_a_real_conveyor_command(overlay):
    version = pyproject()["project"]["version"]
    for owner, template in pod_templates(render(overlay)):
        for c in containers(template):
            # The image's ENTRYPOINT is `conveyor` (test_docker checks it): no override.
            assert "command" not in c, f"{owner}/{c['name']} overrides the `conveyor` entrypoint"
            check_invocation(c["args"])
            name, _, tag = c["image"].partition(":")
            assert name in IMAGES.values() and tag == version, f"{owner}/{c['name']}: image {c['image']}"


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_probes_hit_paths_and_ports_the_command_serves(overlay):
    objs = render(overlay)
    served_ports: dict[str, int] = {}
    for owner, template in pod_templates(objs):
        annotations = template.get("metadata", {}).get("annotations", {})
        for c in containers(template):
            inv = check_invocation(c["args"])
            probes = {k: c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in c}
            if inv.command not in SERVED:
                assert not probes, f"{owner}/{c['name']}: `conveyor {inv.command}` serves nothing to probe"
                continue
            port = inv.port()
            _flag, paths = SERVED[inv.command]
            assert {"livenessProbe", "readinessProbe"} <= set(probes), f"{owner}/{c['name']}"
            assert probes["livenessProbe"]["httpGet"]["path"] == LIVENESS_PATH
            assert probes["readinessProbe"]["httpGet"]["path"] == READINESS_PATH
            for kind, probe in probes.items():
                get = probe["httpGet"]
                assert get["path"] in paths, f"{owner}/{c['name']} {kind}: {get['path']} is not served"
                assert container_port(c, get["port"]) == port, f"{owner}/{c['name']} {kind}: not port {port}"
            assert port in [p["containerPort"] for p in c.get("ports", [])], f"{owner}/{c['name']}"
            # Prometheus scrapes what the command serves.
            assert annotations.get("prometheus.io/scrape") == "true", owner
            assert int(annotations["prometheus.io/port"]) == port, owner
            assert annotations.get("prometheus.io/path", "/metrics") in paths
            if inv.command == "worker":
                # A cold start (download, load) must not trip the liveness probe.
                assert "startupProbe" in probes, f"{owner}: a worker needs a startupProbe"
                startup = probes["startupProbe"]
                assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
            served_ports[template["metadata"]["labels"]["app.kubernetes.io/component"]] = port
            for name in {get["port"] for get in (p["httpGet"] for p in probes.values())}:
                container_port(c, name)
    for svc in find(objs, "Service"):
        pods = [
            (t, c)
            for _o, t in pod_templates(objs)
            for c in containers(t)
            if svc["spec"]["selector"].items() <= t["metadata"]["labels"].items()
        ]
        assert pods, f"Service/{svc['metadata']['name']} selects no pod"
        for _template, c in pods:
            for port in svc["spec"]["ports"]:
                target = container_port(c, port.get("targetPort", port["port"]))
                assert target == check_invocation(c["args"]).port(), f"Service/{svc['metadata']['name']}"


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_grace_period_covers_the_drain(overlay):
    """SIGTERM drains a worker for up to --drain-timeout: Kubernetes must wait at least that
    long before SIGKILL. A Deployment's worker never exits when idle (it would crash-loop)."""
    workers = worker_pods(render(overlay))
    if overlay != "base":
        assert workers, f"{overlay} runs no worker"
    for owner, template, _c, inv in workers:
        drain = float(inv.value("--drain-timeout"))
        assert drain > 0
        assert template["spec"]["terminationGracePeriodSeconds"] >= drain, owner
        if owner.startswith("Deployment/"):
            assert "--exit-when-idle" not in inv.options, owner


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_shm_is_sized_for_torch(overlay):
    for owner, template, c, _inv in worker_pods(render(overlay)):
        mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"), None)
        assert mount, f"{owner}: no /dev/shm volume (the runtime's default is 64 MiB)"
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
        assert volume["emptyDir"]["medium"] == "Memory", owner
        size = parse_quantity(volume["emptyDir"]["sizeLimit"])
        assert size >= 2**30, f"{owner}: /dev/shm under 1 GiB"
        # A memory-backed emptyDir counts against the container's memory limit.
        assert parse_quantity(c["resources"]["limits"]["memory"]) > size, owner


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_workers_request_a_gpu(overlay):
    workers = worker_pods(render(overlay))
    assert workers
    for owner, template, c, _inv in workers:
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        assert int(requests[GPU]) >= 1 and requests[GPU] == limits[GPU], owner
        assert c["image"].partition(":")[0] == IMAGES["cuda"], owner
        tolerations = template["spec"].get("tolerations", [])
        assert any(t["key"] == GPU and t["operator"] == "Exists" for t in tolerations), owner


@pytest.mark.parametrize("overlay", ["base", "cpu", "cpu-embeddings"])
def test_cpu_overlays_ask_for_no_gpu(overlay):
    objs = render(overlay)
    for owner, template in pod_templates(objs):
        for c in containers(template):
            resources = c.get("resources", {})
            assert GPU not in resources.get("requests", {}) and GPU not in resources.get("limits", {}), owner
            assert c["image"].partition(":")[0] == IMAGES["cpu"], owner


def home_dir(df: Dockerfile) -> str:
    """The image user's HOME (``useradd --home-dir``)."""
    for run in df.final.commands:
        match = re.search(r"useradd .*--home-dir (\S+)", run.value[0]) if run.cmd == "RUN" else None
        if match:
            return match.group(1)
    raise AssertionError(f"{df.path.name}: no `useradd --home-dir` in its final stage")


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_pods_run_as_the_image_user_with_writable_paths(overlay):
    """Pods run as the images' non-root user on a read-only root filesystem: every path the
    images write to (their ENV caches, HOME, /tmp) must be a mounted volume."""
    images = {IMAGES[k]: read_dockerfile(p) for k, p in DOCKERFILES.items()}
    for owner, template in pod_templates(render(overlay)):
        pod_security = template["spec"]["securityContext"]
        assert pod_security["runAsNonRoot"] is True, owner
        for c in containers(template):
            df = images[c["image"].partition(":")[0]]
            uid = int(df.last("USER").value[0].partition(":")[0])
            assert pod_security.get("runAsUser", uid) == uid, f"{owner}: runAsUser is not the image's user {uid}"
            security = c["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
            if not security.get("readOnlyRootFilesystem"):
                continue
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            env = df.env()
            caches = [env.get(k) for k in ("HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "CONVEYOR_HOME")]
            writable = ["/tmp", home_dir(df), *(p for p in caches if p)]
            for path in writable:
                assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), (
                    f"{owner}/{c['name']}: {path} is on the read-only root filesystem"
                )


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_no_secret_values_committed(overlay):
    objs = render(overlay)
    assert not find(objs, "Secret"), "secrets are created on the cluster, never committed"
    for key, value in config(objs).items():
        assert not SECRET_LOOKING.search(key), f"ConfigMap key {key} belongs in the Secret"
        assert not URL_WITH_PASSWORD.search(value), f"ConfigMap {key} holds a password"
    for owner, template in pod_templates(objs):
        for c in containers(template):
            for env in c.get("env", []):
                assert not (SECRET_LOOKING.search(env["name"]) and "value" in env), f"{owner}: {env['name']} literal"
            secret_refs = [e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e]
            assert secret_refs == [SECRET_NAME], f"{owner}/{c['name']} must read the {SECRET_NAME} Secret"
    assert not URL_WITH_PASSWORD.search(_render(overlay)), "a URL with a password in the manifests"


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_config_names_real_settings(overlay):
    known = settings_variables()
    for key in config(render(overlay)):
        if key.startswith("CONVEYOR_"):
            assert key in known, f"{key} is not a Conveyor setting (conveyor/worker/core/settings.py)"
        else:
            assert OTHER_CONFIG.match(key), f"{key}: not a setting any Conveyor process reads"


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_disruption_budgets_select_long_running_pods(overlay):
    objs = render(overlay)
    for pdb in find(objs, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        owners = [o for o, t in pod_templates(objs) if selector.items() <= t["metadata"]["labels"].items()]
        assert owners, f"PodDisruptionBudget/{pdb['metadata']['name']} selects no pod"
        # maxUnavailable needs a scalable owner: a Job's pods cannot be evicted under it.
        assert all(o.startswith("Deployment/") for o in owners), f"{pdb['metadata']['name']}: {owners}"
    if overlay in ("cpu", "cpu-embeddings", "gpu"):
        assert len(find(objs, "PodDisruptionBudget")) == 2


@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_migration_job_upgrades_the_schema(overlay):
    objs = render(overlay)
    migrations = [
        (o, c)
        for o in find(objs, "Job")
        for c in containers(o["spec"]["template"])
        if c["args"][:2] == ["db", "upgrade"]
    ]
    assert len(migrations) == 1, "one Job runs `conveyor db upgrade`"
    job, c = migrations[0]
    check_invocation(c["args"])
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    # Deleted after it ran, so that the next apply (a new image) runs it again.
    assert job["spec"].get("ttlSecondsAfterFinished") is not None
