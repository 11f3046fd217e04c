"""infra/docker: the Dockerfiles (parsed with BuildKit's own parser) install exactly what the
package declares (its lock file's exact versions, its `conveyor` script, the Makefile's torch), as a non-root user
with the model cache on a volume; and what they install works: the package built from exactly
the files they COPY runs `conveyor db upgrade` outside the source tree.

No Docker daemon here, so no image is built; these checks stand in for the build."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.infra.contract import (
    DOCKERFILES,
    IMAGES,
    ROOT,
    SERVED,
    Dockerfile,
    check_invocation,
    makefile_torch_version,
    pyproject,
    read_dockerfile,
)
from tests.infra.locks import IMAGE_LOCKS, lock_pins

# Python in each base image family (the CUDA image uses the distribution's python3).
DISTRO_PYTHON = {"ubuntu24.04": "3.12", "ubuntu22.04": "3.10"}
DEV_EXTRAS = {"dev", "test"}


def dockerfile(kind: str) -> Dockerfile:
    return read_dockerfile(DOCKERFILES[kind])


def install_runs(df: Dockerfile) -> list[str]:
    return [c.value[0] for c in df.all("RUN") if re.search(r"\bpip install\b", c.value[0])]


def lock_installs(df: Dockerfile) -> list[str]:
    """The lock files the Dockerfile installs: `pip install --require-hashes --no-deps -r LOCK`."""
    found = []
    for run in install_runs(df):
        match = re.search(r"-r (requirements/\S+\.lock)", run)
        if match:
            assert "--require-hashes" in run and "--no-deps" in run, f"{df.path.name}: {run}"
            found.append(match.group(1))
    return found


def dockerignore_excludes(path: str) -> bool:
    """Whether the root .dockerignore keeps ``path`` (relative, '/'-separated) out of the
    build context: the last matching pattern wins, `!` re-includes, a directory pattern covers
    what is under it."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        candidates = [path] + ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1)]
        if pattern.startswith("**/"):
            candidates += [c.split("/", i)[-1] for c in list(candidates) for i in range(c.count("/") + 1)]
            pattern = pattern[3:]
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_multi_stage_build_with_the_venv_copied_over(kind):
    df = dockerfile(kind)
    assert len(df.stages) >= 2, "build in one stage, run in a clean one"
    bases = {s.base for s in df.stages}
    assert len(bases) == 1, f"build and runtime stages must share a base (the venv's python): {bases}"
    copies = [c for c in df.final.commands if c.cmd == "COPY" and c.flags]
    assert any(c.flags == ("--from=build",) and c.value == ("/opt/venv", "/opt/venv") for c in copies)
    assert "/opt/venv/bin" in df.env()["PATH"]
    assert not [c for c in df.final.commands if c.cmd == "RUN" and "pip install" in c.value[0]]


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_base_images_are_pinned(kind):
    for stage in dockerfile(kind).stages:
        image, _, tag = stage.base.partition(":")
        assert image and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"pin {stage.base}"


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_installs_its_lock_then_the_package_alone(kind):
    df = dockerfile(kind)
    assert lock_installs(df) == [IMAGE_LOCKS[kind].path], f"{df.path.name} installs {lock_installs(df)}"
    assert IMAGE_LOCKS[kind].path in copied_sources(df), "the lock is copied into the build context"
    runs = install_runs(df)
    package = [r for r in runs if re.search(r"pip install --no-deps \.(\s|$)", r)]
    assert len(package) == 1, f"{df.path.name}: install the package once, --no-deps, after its lock"
    assert runs.index(package[0]) > runs.index(next(r for r in runs if "--require-hashes" in r))
    assert "worker" in IMAGE_LOCKS[kind].extras
    assert not IMAGE_LOCKS[kind].extras & DEV_EXTRAS, "no test or lint tools in an image"
    if kind == "cuda":
        assert "triton" in IMAGE_LOCKS[kind].extras, "the CUDA image needs the Triton kernels"


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_entrypoint_is_the_declared_conveyor_script(kind):
    df = dockerfile(kind)
    entrypoint = df.last("ENTRYPOINT")
    assert entrypoint.json and list(entrypoint.value) == ["conveyor"]
    assert pyproject()["project"]["scripts"]["conveyor"] == "conveyor.worker.entrypoints.cli:main"
    # The build stage proves the script runs.
    assert any("conveyor --version" in r for r in install_runs(df))


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_torch_is_the_makefile_version_and_python_the_locks(kind):
    df = dockerfile(kind)
    lock = IMAGE_LOCKS[kind]
    torch = lock_pins(ROOT / lock.path)["torch"]
    assert torch == makefile_torch_version() + ("+cpu" if kind == "cpu" else ""), torch
    if kind == "cpu":
        # The CPU wheel index: PyPI's Linux torch is the multi-GB CUDA build.
        assert df.args["TORCH_INDEX_URL"].endswith("/whl/cpu")
        assert "${TORCH_INDEX_URL}" in next(r for r in install_runs(df) if "--require-hashes" in r)
    assert image_python(df) == lock.python, f"{lock.path} is resolved for CPython {lock.python}"


def image_python(df: Dockerfile) -> str:
    base = df.final.base
    match = re.match(r"python:(\d+\.\d+)", base)
    distro = next((d for d in DISTRO_PYTHON if d in base), None)
    assert match or distro, f"which python does {base} have? (add it to DISTRO_PYTHON)"
    return match.group(1) if match else DISTRO_PYTHON[str(distro)]


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_python_meets_requires_python(kind):
    python = image_python(dockerfile(kind))
    assert Version(python) in SpecifierSet(pyproject()["project"]["requires-python"])


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_runs_as_non_root_with_the_model_cache_on_a_volume(kind):
    df = dockerfile(kind)
    user = df.last("USER").value[0]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, "a numeric non-root USER (runAsNonRoot can check it)"
    volumes = [v for c in df.final.commands if c.cmd == "VOLUME" for v in c.value]
    hf_home = df.env()["HF_HOME"]
    volume = next((v for v in volumes if hf_home.startswith(v.rstrip("/") + "/")), None)
    assert volume, f"HF_HOME={hf_home} is not under a VOLUME ({volumes})"
    # The image user can write there (a new named volume copies the image's ownership).
    assert any(re.search(rf"chown {uid}(:{gid})? {volume}\b", c.value[0]) for c in df.final.commands if c.cmd == "RUN")


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_exposes_what_its_commands_serve(kind):
    exposed = {int(p) for c in dockerfile(kind).final.commands if c.cmd == "EXPOSE" for p in c.value}
    from tests.infra.test_compose import command, conveyor_services

    served = {
        check_invocation(command(s)).port()
        for s in conveyor_services().values()
        if s["image"].partition(":")[0] == IMAGES[kind] and command(s)[0] in SERVED
    }
    assert served and served <= exposed, f"{kind}: serves {served}, exposes {exposed}"


def copied_sources(df: Dockerfile) -> list[str]:
    """What the Dockerfile copies from the build context."""
    out: list[str] = []
    for c in df.all("COPY"):
        if not any(f.startswith("--from") for f in c.flags):
            out += list(c.value[:-1])
    return out


@pytest.mark.parametrize("kind", list(DOCKERFILES))
def test_copies_the_whole_package_and_dockerignore_lets_it_through(kind):
    sources = copied_sources(dockerfile(kind))
    meta = pyproject()
    packages = {p.split(".")[0].rstrip("*") for p in meta["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = {"pyproject.toml", meta["project"]["readme"], *packages}
    assert needed <= set(sources), f"not copied: {needed - set(sources)}"
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not dockerignore_excludes(source), f".dockerignore keeps {source} out of the build context"
        assert not dockerignore_excludes(f"{source}/x.py" if (ROOT / source).is_dir() else source)
    # ...and keeps the rest out (the context stays small, no local state leaks into an image).
    for other in ("tests", ".venv", ".git", ".cache", "benchmarks", "conveyor/worker/__pycache__/x.pyc"):
        assert dockerignore_excludes(other), f".dockerignore lets {other} into the build context"


def _can_build_without_isolation() -> bool:
    try:
        return Version(installed_version("setuptools")) >= Version("70.1")  # bdist_wheel built in
    except Exception:
        return False


def test_the_package_the_images_build_runs_outside_the_source_tree(tmp_path):
    """Build the wheel from exactly what the Dockerfile COPYs (the image's build step), then
    run `conveyor db upgrade` from it, away from the repository: the migrations must be in the
    package, not found through the source tree."""
    context = tmp_path / "context"
    for source in copied_sources(dockerfile("cpu")):
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (context / source).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, context / source)
    wheels = tmp_path / "wheels"
    # Without isolation where the installed setuptools can build wheels (no download); else
    # pip fetches the build backend (setuptools>=68) from PyPI, as the image build does.
    flags = ["--no-build-isolation"] if _can_build_without_isolation() else []
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *flags, "-w", str(wheels), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    [wheel] = wheels.glob("conveyor-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(site)
    assert any(n.startswith("conveyor/migrations/versions/") and n.endswith(".py") for n in names), (
        "migrations not packaged"
    )
    # One importable name: nothing but conveyor/ and its dist-info at the top of site-packages.
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"conveyor"}, sorted(tops)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "conveyor = conveyor.worker.entrypoints.cli:main" in (site / entry_points).read_text()

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(PYTHONPATH=str(site), CONVEYOR_HOME=str(home))
    script = (
        "import sys, conveyor.worker, conveyor.migrations; from conveyor.worker.entrypoints.cli import main; "
        "print(conveyor.worker.__file__); print(conveyor.migrations.__file__); sys.exit(main(['db', 'upgrade']))"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    worker_file, migrations_file, message = run.stdout.splitlines()[:3]
    assert Path(worker_file).is_relative_to(site) and Path(migrations_file).is_relative_to(site), run.stdout
    assert "schema revision" in message and (home / "conveyor.db").exists()
