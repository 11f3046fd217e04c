"""An exclusive lock on a file, across the processes of one machine (POSIX ``flock``; where
there is none, no lock): how processes starting at once on one node take turns, e.g. to
migrate the embedded database or to fetch a model into the shared cache."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: nothing to lock with
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
