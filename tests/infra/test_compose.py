"""infra/compose.yaml: it parses, and what it runs is real: `conveyor` command lines the CLI
accepts, the settings Conveyor reads, ports and health checks on what each command serves,
start-up ordered by health, and a worker given its drain time before it is killed.

No Docker daemon here: where a `docker compose` (v2) binary is installed, it also checks the
file against the Compose specification (`config --quiet`, which needs no daemon)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from conveyor.worker.core.catalog import parse_catalog
from tests.infra.contract import (
    DOCKERFILES,
    IMAGES,
    INFRA,
    READINESS_PATH,
    ROOT,
    SERVED,
    check_invocation,
    parse_duration,
    pyproject,
    settings_variables,
)

COMPOSE = INFRA / "compose.yaml"
OUR_IMAGES = set(IMAGES.values())
BACKING = {"postgres", "redis", "minio"}


@lru_cache(maxsize=1)
def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose() -> dict[str, Any]:
    return _compose()


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with the defaults (what a bare `docker compose up` runs)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def environment(service: dict[str, Any]) -> dict[str, str | None]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: None if v is None else interpolate(str(v)) for k, v in env.items()}


def conveyor_services() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services().items() if s.get("image", "").partition(":")[0] in OUR_IMAGES}


def command(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    assert isinstance(cmd, list), "write commands as lists (no shell splitting surprises)"
    return [interpolate(str(a)) for a in cmd]


def workers() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in conveyor_services().items() if command(s)[0] == "worker"}


def healthcheck_url(service: dict[str, Any]) -> str:
    test = " ".join(service["healthcheck"]["test"])
    match = re.search(r"https?://[^'\" ]+", test)
    assert match, f"no URL in the health check {test!r}"
    return match.group(0)


def test_compose_parses_with_the_expected_services():
    assert compose()["name"] == "conveyor"
    assert {"postgres", "redis", "minio", "createbucket", "migrate", "api", "worker", "worker-gpu"} <= set(services())
    for name, service in services().items():
        assert "image" in service or "build" in service, name
        image = service.get("image", "")
        assert image and not image.endswith(":latest") and ":" in image, f"{name}: pin the image ({image!r})"


def test_every_conveyor_service_runs_a_real_command():
    version = pyproject()["project"]["version"]
    for name, service in conveyor_services().items():
        assert "entrypoint" not in service, f"{name} overrides the `conveyor` entrypoint"
        check_invocation(command(service))
        assert service["image"].partition(":")[2] == version, f"{name}: tag the image with the package version"
    commands = {name: command(s)[:2] for name, s in conveyor_services().items()}
    assert commands["migrate"] == ["db", "upgrade"]
    assert commands["api"][0] == "serve"


def test_images_are_built_from_the_dockerfiles():
    """Each service of one of our images builds it (a service that only names a local-only
    image makes a fresh `docker compose up` try to pull it from a registry)."""
    dockerfiles = {IMAGES[kind]: path for kind, path in DOCKERFILES.items()}
    built = set()
    for name, service in conveyor_services().items():
        image = service["image"].partition(":")[0]
        build = service.get("build")
        assert build, f"{name} runs {image} but does not build it"
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT, "the images build from the repository root (.dockerignore is there)"
        assert (context / build["dockerfile"]).resolve() == dockerfiles[image], name
        built.add(image)
    assert built == OUR_IMAGES


def test_environment_names_real_settings_and_services():
    known = settings_variables()
    for name, service in conveyor_services().items():
        env = environment(service)
        for key in env:
            assert not key.startswith("CONVEYOR_") or key in known, f"{name}: {key} is not a Conveyor setting"
        db = urlsplit(env["CONVEYOR_DATABASE_URL"] or "")
        assert db.scheme.startswith("postgresql") and db.hostname == "postgres", name
        assert urlsplit(env["CONVEYOR_BROKER_URL"] or "").hostname == "redis", name
        storage = urlsplit(env["CONVEYOR_STORAGE_URL"] or "")
        assert storage.scheme == "s3", name
        endpoint = urlsplit(env["AWS_ENDPOINT_URL_S3"] or "")
        assert endpoint.hostname == "minio" and endpoint.port == 9000, name
        # The bucket the store names is the one the one-shot creates.
        assert f"local/{storage.hostname}" in " ".join(services()["createbucket"]["command"]), name


def test_the_catalog_declares_the_workers_model():
    """The API accepts batches for declared models while the worker is still loading."""
    for name, service in conveyor_services().items():
        catalog = parse_catalog(environment(service).get("CONVEYOR_MODELS"))
        for worker_name, worker in workers().items():
            inv = check_invocation(command(worker))
            model = inv.options.get("--served-model-name") or inv.value("--model")
            assert model in catalog, f"{name}: CONVEYOR_MODELS {catalog} omits {worker_name}'s model {model!r}"


def test_ports_and_health_checks_hit_what_each_command_serves():
    for name, service in conveyor_services().items():
        inv = check_invocation(command(service))
        if inv.command not in SERVED:
            assert "healthcheck" not in service and "ports" not in service, name
            continue
        port = inv.port()
        url = urlsplit(healthcheck_url(service))
        assert url.port == port and url.path == READINESS_PATH, f"{name}: health check {url.geturl()}"
        assert url.path in SERVED[inv.command][1]
        published = [str(p).rsplit(":", 1)[-1] for p in service.get("ports", [])]
        assert published == [str(port)], f"{name}: publishes {published}, serves {port}"
    for name in BACKING:
        assert "healthcheck" in services()[name], f"{name} needs a health check (services wait on it)"


def test_startup_is_ordered_by_health():
    svc = services()
    for name, service in svc.items():
        for dep, cond in service.get("depends_on", {}).items():
            assert dep in svc, f"{name} depends on a missing service {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in svc[dep], f"{name} waits for {dep} to be healthy; it has no health check"
            if cond["condition"] == "service_completed_successfully":
                assert svc[dep].get("restart", "no") == "no", f"{dep} is a one-shot: it must not restart"
    assert svc["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert svc["createbucket"]["depends_on"]["minio"]["condition"] == "service_healthy"
    for name in ["api", *workers()]:
        deps = svc[name]["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["createbucket"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name


def test_cpu_worker_by_default_gpu_worker_in_a_profile():
    cpu, gpu = services()["worker"], services()["worker-gpu"]
    assert not cpu.get("profiles"), "the CPU worker starts with a plain `docker compose up`"
    assert "deploy" not in cpu
    assert cpu["image"].partition(":")[0] == IMAGES["cpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["image"].partition(":")[0] == IMAGES["cuda"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    for name in ("worker", "worker-gpu"):
        assert check_invocation(command(services()[name])).value("--model")


def test_an_embedding_worker_in_a_profile_serves_a_catalogued_model():
    embed = services()["worker-embed"]
    assert embed["profiles"] == ["embed"]
    assert embed["image"].partition(":")[0] == IMAGES["cpu"] and "deploy" not in embed
    model = check_invocation(command(embed)).value("--model")
    assert model == "BAAI/bge-small-en-v1.5"
    assert model in parse_catalog(environment(services()["api"]).get("CONVEYOR_MODELS"))


def test_workers_get_their_drain_time_before_sigkill():
    for name, service in workers().items():
        inv = check_invocation(command(service))
        drain = float(inv.value("--drain-timeout"))
        assert parse_duration(service["stop_grace_period"]) >= drain, name
        assert "--exit-when-idle" not in inv.options, f"{name} restarts: it must not exit when idle"
        assert service.get("init") is True, f"{name}: an init process forwards SIGTERM and reaps children"
        assert any(v.endswith(":/cache") for v in service["volumes"]), f"{name}: keep the model cache in a volume"


def test_no_secret_without_an_override():
    """Passwords are local-development defaults that the environment overrides."""
    text = COMPOSE.read_text()
    for name, service in services().items():
        for key, value in (service.get("environment") or {}).items():
            if re.search(r"PASSWORD|SECRET", key) and value is not None:
                assert re.fullmatch(r"\$\{\w+:-[^}]*\}", str(value)), f"{name}: {key} must be ${{VAR:-default}}"
    assert "HF_TOKEN: ${HF_TOKEN" not in text, "pass HF_TOKEN through (no value), never a default"


def _compose_binary() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    return None


@pytest.mark.parametrize("profile", [None, "gpu", "embed"])
def test_compose_spec_accepts_the_file(profile):
    binary = _compose_binary()
    if binary is None:
        pytest.skip("no `docker compose` here to check the file against the Compose specification")
    args = [*binary, "-f", str(COMPOSE), *(["--profile", profile] if profile else []), "config", "--quiet"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
