"""Writing a job's lines (results, errors, unfinished input) to a file or stdout."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import BinaryIO

from conveyor.worker.core.terminal_text import json_for_terminal


def write_lines(lines: Iterable[bytes], path: str | None, *, live: bool = False) -> int:
    """Write to ``path`` (atomically, via a ``.partial`` file) or stdout. ``live`` (for
    ``--follow``): every line is flushed as it comes, to ``path`` itself, which grows line by
    line."""
    if path is None or path == "-":
        return _write_stdout(lines, live=live)
    if live:
        with open(path, "wb") as f:
            return _write_flushed(lines, f)
    tmp = f"{path}.partial"
    with open(tmp, "wb") as f:
        count = 0
        for line in lines:
            f.write(line)
            count += 1
    os.replace(tmp, path)
    return count


def _write_stdout(lines: Iterable[bytes], *, live: bool) -> int:
    """To stdout, made safe for a terminal when it is one; flushed every line when ``live``."""
    out = sys.stdout.buffer
    terminal = sys.stdout.isatty()
    count = 0
    for line in lines:
        out.write(json_for_terminal(line) if terminal else line)
        count += 1
        if live or count % 64 == 0:
            out.flush()
    out.flush()
    return count


def _write_flushed(lines: Iterable[bytes], f: BinaryIO) -> int:
    count = 0
    for line in lines:
        f.write(line)
        f.flush()
        count += 1
    return count
