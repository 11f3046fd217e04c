"""Some records of an input, in its own format and bytes: what ``results --unfinished`` gives
back to resubmit.

Records are chosen by the line numbers the readers give them (a JSONL line's physical line,
a CSV record's first physical line, a Parquet row's number), so the choice matches the items
intake made. JSONL lines and CSV records are copied verbatim (a CSV keeps its header record);
a Parquet file's rows are taken into a new file with its schema.
"""

from __future__ import annotations

import csv
import tempfile
from collections.abc import Callable, Container, Iterator
from typing import Any

from conveyor.worker.batchio.line_reader import BOM, ByteStream, LineReader, jsonl_lines
from conveyor.worker.batchio.records import InputFormat
from conveyor.worker.core.limits import DEFAULT_LIMITS, InputLimits

# The input was read once already under the deployment's limits: only line numbers matter now.
_ANY_SIZE = InputLimits(max_input_bytes=1 << 62, max_lines=1 << 62, max_line_bytes=DEFAULT_LIMITS.max_line_bytes)


def write_subset(stream: ByteStream, fmt: InputFormat, lines: Container[int], write: Callable[[bytes], Any]) -> int:
    """Write the records of ``stream`` whose line numbers are in ``lines``; how many."""
    if fmt is InputFormat.parquet:
        return _parquet_rows(stream, lines, write)
    records = _csv_records if fmt is InputFormat.csv else _jsonl_records
    count = 0
    for is_header, line, data in records(stream):
        if is_header or line in lines:
            write(data if data.endswith(b"\n") else data + b"\n")
            count += 0 if is_header else 1
    return count


def _jsonl_records(stream: ByteStream) -> Iterator[tuple[bool, int, bytes]]:
    for line, raw in jsonl_lines(LineReader(stream, _ANY_SIZE)):
        if raw is not None:  # (a line too long was refused at intake: never unrun)
            yield False, line, raw


def _csv_records(stream: ByteStream) -> Iterator[tuple[bool, int, bytes]]:
    """``(is the header, first line, its physical lines)`` per CSV record: csv reads exactly the
    physical lines a record spans, so those taken since the last record are this one's."""
    if csv.field_size_limit() < _ANY_SIZE.max_line_bytes:  # (process-wide, as csv_input raises it)
        csv.field_size_limit(_ANY_SIZE.max_line_bytes)
    source = iter(LineReader(stream, _ANY_SIZE))
    taken: list[tuple[int, bytes]] = []

    def physical() -> Iterator[str]:
        for line, raw in source:
            data = raw or b""
            taken.append((line, data))
            yield (data.removeprefix(BOM) if line == 1 else data).decode("utf-8", errors="replace")

    header_seen = False
    reader = csv.reader(physical())
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error:  # (refused at intake: never unrun) resume at the next physical line
            taken.clear()
            reader = csv.reader(physical())
            continue
        record, first = b"".join(raw for _line, raw in taken), taken[0][0]
        taken.clear()
        if not any(cell.strip() for cell in row):
            continue
        yield not header_seen, first, record
        header_seen = True


def _parquet_rows(stream: ByteStream, lines: Container[int], write: Callable[[bytes], Any]) -> int:
    # pyarrow: an optional extra, needed only for Parquet (it read this input already).
    import pyarrow.parquet as pq

    with tempfile.SpooledTemporaryFile(max_size=64 << 20) as spool, tempfile.TemporaryFile() as out:
        while chunk := stream.read(1 << 20):
            spool.write(chunk)
        spool.seek(0)
        table = pq.read_table(spool)
        keep = [i for i in range(table.num_rows) if i + 1 in lines]
        pq.write_table(table.take(keep), out)
        out.seek(0)
        while chunk := out.read(1 << 20):
            write(chunk)
    return len(keep)
