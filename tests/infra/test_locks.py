"""The lock files agree with pyproject.toml: every requirement of the extras a lock is for is
pinned there, at a version its range allows, with a hash. A range changed without `make lock`
fails here, not in an image build."""

from __future__ import annotations

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.infra.contract import ROOT, makefile_torch_version, pyproject
from tests.infra.locks import DEV_LOCK, IMAGE_LOCKS, Lock, lock_pins

LOCKS = [DEV_LOCK, *IMAGE_LOCKS.values()]


def requirements_of(extras: frozenset[str]) -> list[Requirement]:
    """The package's own requirements and those of ``extras``, its self-references expanded."""
    project = pyproject()["project"]
    name = canonicalize_name(project["name"])
    found: list[Requirement] = [Requirement(r) for r in project["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == name:
                todo += list(req.extras)
            else:
                found.append(req)
    return found


def target_environment(lock: Lock) -> dict[str, str]:
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    env.update(python_version=lock.python, python_full_version=f"{lock.python}.0", sys_platform="linux")
    env.update(platform_system="Linux", platform_machine="x86_64", implementation_name="cpython")
    return env


@pytest.mark.parametrize("lock", LOCKS, ids=lambda lock: lock.path)
def test_every_requirement_is_pinned_inside_its_range(lock: Lock) -> None:
    pins = lock_pins(ROOT / lock.path)
    env = target_environment(lock)
    problems = []
    for req in requirements_of(lock.extras):
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None:
            problems.append(f"{req.name} is not pinned")
        elif not req.specifier.contains(Version(pinned), prereleases=True):
            problems.append(f"{req.name}=={pinned} is outside {req.specifier}")
    assert not problems, f"{lock.path} is stale (run `make lock`): " + "; ".join(problems)


@pytest.mark.parametrize("lock", LOCKS, ids=lambda lock: lock.path)
def test_torch_is_the_makefile_version(lock: Lock) -> None:
    torch = Version(lock_pins(ROOT / lock.path)["torch"])
    assert torch.public == makefile_torch_version()


def test_a_stale_lock_is_found(tmp_path, monkeypatch) -> None:
    text = (ROOT / DEV_LOCK.path).read_text()
    pins = lock_pins(ROOT / DEV_LOCK.path)
    stale = text.replace(f"transformers=={pins['transformers']} ", "transformers==4.40.0 ")
    assert stale != text
    (tmp_path / "requirements").mkdir()
    (tmp_path / DEV_LOCK.path).write_text(stale)
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"transformers==4\.40\.0 is outside"):
        test_every_requirement_is_pinned_inside_its_range(DEV_LOCK)
