"""The lock files (requirements/*.lock, `make lock`): what each is for, and their pins read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name


@dataclass(frozen=True)
class Lock:
    path: str  # relative to the repository root
    extras: frozenset[str]  # the package's extras it is resolved with
    python: str  # the CPython it is resolved for


DEV_LOCK = Lock("requirements/dev-cpu.lock", frozenset({"dev"}), "3.11")
IMAGE_LOCKS = {
    "cpu": Lock("requirements/image-cpu.lock", frozenset({"worker", "parquet"}), "3.11"),
    "cuda": Lock("requirements/image-cuda.lock", frozenset({"worker", "triton", "parquet"}), "3.12"),
}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(\S+)")


def lock_pins(path: Path) -> dict[str, str]:
    """Each pinned distribution's canonical name -> its version; every pin carries a hash."""
    pins: dict[str, str] = {}
    text = path.read_text()
    for block in re.split(r"\n(?=\S)", text):
        match = PIN.match(block)
        if match is None:
            continue
        assert "--hash=sha256:" in block, f"{path.name}: {match.group(1)} has no hash"
        pins[canonicalize_name(match.group(1))] = match.group(3)
    return pins
