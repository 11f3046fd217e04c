"""An input file's whole-file problems that its start shows, found before anything costly
(``conveyor run`` loading its model): not text, a CSV or Parquet header without a ``prompt``,
``messages`` or ``input`` column, no request at all. Only the first record is read (a Parquet
file's footer alone); each line's own problems are left to the job."""

from __future__ import annotations

from pathlib import Path

from conveyor.worker.batchio import parquet_input
from conveyor.worker.batchio.peek import peek
from conveyor.worker.batchio.readers import detect_format, iter_input
from conveyor.worker.batchio.records import InputFormat
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.core.limits import InputLimits


def check_input_start(
    path: Path, limits: InputLimits, fmt: InputFormat | None = None, options: RequestOptions | None = None
) -> InputFormat:
    """The input's format (``fmt``, else detected as a submission does); ``InputError`` for
    a problem of the whole file its start shows."""
    with open(path, "rb") as f:
        head, stream = peek(f)
        fmt = fmt or detect_format(path.name, head)
        if fmt is InputFormat.parquet:
            parquet_input.check_header(path)
        else:
            next(iter_input(stream, limits, fmt, options), None)
    return fmt
