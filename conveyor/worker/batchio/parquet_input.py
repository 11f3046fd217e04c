"""Parquet input: a ``prompt`` or ``messages`` column, rows numbered from 1 like lines
(needs pyarrow: ``conveyor[parquet]``)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conveyor.worker.batchio.line_reader import ByteStream, too_big, too_many
from conveyor.worker.batchio.records import InputError, LineError, ParsedRequest, record_from_object
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.core.limits import InputLimits

_PARQUET_SPOOL_BYTES = 64 * 1024 * 1024  # larger inputs spill to a temporary file
_PARQUET_BATCH_ROWS = 1024


def _rows(batch: Any) -> Iterator[dict[str, Any] | str]:
    """A record batch as dicts; a row pyarrow cannot convert to Python (a string that is not
    UTF-8, a timestamp out of range) as what is wrong with it, so the other rows still come."""
    try:
        yield from batch.to_pylist()
        return
    except Exception:
        pass
    for i in range(batch.num_rows):
        try:
            (record,) = batch.slice(i, 1).to_pylist()
        except Exception as exc:
            yield _unreadable(batch, i, exc)
        else:
            yield record


def _unreadable(batch: Any, i: int, exc: Exception) -> str:
    for name in batch.schema.names:
        try:
            batch.column(name).slice(i, 1).to_pylist()
        except Exception as col_exc:
            return f"column {name!r} of this row cannot be read: {type(col_exc).__name__}: {col_exc}"
    return f"row cannot be read: {type(exc).__name__}: {exc}"


def _record(
    row: int, record: dict[str, Any], limits: InputLimits, options: RequestOptions
) -> ParsedRequest | LineError:
    obj = {k.lower(): v for k, v in record.items() if v is not None}
    size = len(json.dumps(obj, default=str).encode("utf-8", "surrogatepass"))
    if size > limits.max_line_bytes:
        return LineError(
            row, "line_too_long", f"row is {size} bytes, more than {limits.max_line_bytes} (CONVEYOR_MAX_LINE_BYTES)"
        )
    return record_from_object(obj, row, limits, options)


def check_columns(names: list[str]) -> None:
    """``InputError`` unless the file's columns include one a request is read from."""
    columns = [name.lower() for name in names]
    if not {"prompt", "messages", "input"} & set(columns):
        raise InputError(
            f"the Parquet file has no 'prompt', 'messages' or 'input' column (columns: {', '.join(columns)})"
        )


def check_header(path: Path) -> None:
    """The columns of the Parquet file at ``path``, checked from its footer alone (no row is read)."""
    pq = _pyarrow_parquet()
    try:
        names = pq.ParquetFile(path).schema_arrow.names
    except Exception as exc:
        raise InputError(f"cannot read the Parquet file: {exc}") from None
    check_columns(names)


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("Parquet input needs pyarrow: pip install 'conveyor[parquet]'") from None
    return pq


def iter_parquet(
    stream: ByteStream, limits: InputLimits, options: RequestOptions | None = None
) -> Iterator[ParsedRequest | LineError]:
    options = options or RequestOptions()
    pq = _pyarrow_parquet()
    # Parquet keeps its schema at the end of the file: spool the stream (bounded memory)
    # to read it with random access, batch by batch.
    with tempfile.SpooledTemporaryFile(max_size=_PARQUET_SPOOL_BYTES) as spool:
        total = 0
        while chunk := stream.read(1 << 20):
            total += len(chunk)
            if total > limits.max_input_bytes:
                raise too_big(limits)
            spool.write(chunk)
        spool.seek(0)
        try:
            parquet = pq.ParquetFile(spool)
        except Exception as exc:
            raise InputError(f"cannot read the Parquet file: {exc}") from None
        check_columns(parquet.schema_arrow.names)
        row = 0
        batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except Exception as exc:  # a damaged row group: no row number to blame
                raise InputError(f"cannot read the Parquet file after row {row}: {exc}") from None
            for record in _rows(batch):
                row += 1
                if row > limits.max_lines:
                    raise too_many(limits, "rows")
                if isinstance(record, str):
                    yield LineError(row, "invalid_row", record)
                else:
                    yield _record(row, record, limits, options)
