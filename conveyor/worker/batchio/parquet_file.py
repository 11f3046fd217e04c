"""Parquet written as rows stream in, a row group at a time (memory stays one row group, whatever
the job's size), into a path that gets the whole file or nothing."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

ROWS_PER_GROUP = 8192

Target = str | os.PathLike[str] | BinaryIO


class RowGroupWriter:
    """Rows (a value per column of ``schema``, a ``pyarrow.Schema``) appended one at a time;
    each full row group is written, the last one at ``close``."""

    def __init__(self, out: str | BinaryIO, schema: Any, rows_per_group: int = ROWS_PER_GROUP) -> None:
        import pyarrow.parquet as pq

        self._schema = schema
        self._rows_per_group = rows_per_group
        self._columns: dict[str, list[Any]] = {name: [] for name in schema.names}
        self._pending = 0
        self._writer = pq.ParquetWriter(out, schema)

    def append(self, row: Mapping[str, Any]) -> None:
        for name, values in self._columns.items():
            values.append(row.get(name))
        self._pending += 1
        if self._pending >= self._rows_per_group:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if not self._pending:
            return
        arrays = [pa.array(self._columns[f.name], type=f.type) for f in self._schema]
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=self._schema))
        self._columns = {name: [] for name in self._schema.names}
        self._pending = 0

    def close(self) -> None:
        try:
            self._flush()
        finally:
            self._writer.close()


def write_whole(out: Target, write: Callable[[str | BinaryIO], int]) -> int:
    """``write(target)`` into ``out``; its result. A path gets the whole file or nothing: it is
    written beside it under a temporary name and renamed into place once complete (removed if
    anything fails, an older file left as it was)."""
    if not isinstance(out, (str, os.PathLike)):
        return write(out)
    target = Path(out)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    os.close(fd)
    try:
        count = write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count
