"""Fixtures shared by all tests: tiny random-weight models built locally once per session."""

from __future__ import annotations

import os

import pytest

# pytest-xdist runs one test process per core: one math thread each (inherited by the worker
# subprocesses tests start), or OpenMP threads of the processes stall one another. Set before
# torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Both import torch: imported after OMP_NUM_THREADS is set.
from conveyor.kernels.interpreter import enable_interpreter
from conveyor.testing.tiny_models import build_tiny_model

# The kernels run in Triton's interpreter (CPU has no GPU to run them) unless CONVEYOR_TEST_GPU=1
# or TRITON_INTERPRET says otherwise; chosen before anything imports triton.
if os.environ.get("CONVEYOR_TEST_GPU") != "1":
    enable_interpreter(unless_set=True)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> checkpoint directory, built on first use."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[str, str] = {}

    def get(family: str, **kwargs) -> str:
        key = family + "".join(f"-{k}={v}" for k, v in sorted(kwargs.items()))
        if key not in cache:
            cache[key] = str(build_tiny_model(root / key.replace("/", "_"), family, **kwargs))
        return cache[key]

    return get


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark what is not pure (services, subprocess, gpu, slow): ``tests/markers.py`` decides;
    and start the longest files first (``tests/xdist_order.py``)."""
    from tests.markers import apply
    from tests.xdist_order import longest_first

    apply(items)
    longest_first(items)
