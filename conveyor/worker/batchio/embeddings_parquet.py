"""A job's embeddings as Parquet (``conveyor results JOB --format parquet``): one row per
vector, ``custom_id``, ``index`` (the input's place in its line) and ``embedding`` (a
fixed-size list of float32), written from the results file's lines as they stream in, a row
group at a time, so memory stays bounded by one row group whatever the job's size."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterable
from typing import Any, BinaryIO

from conveyor.worker.batchio.parquet_file import ROWS_PER_GROUP, RowGroupWriter, Target, write_whole
from conveyor.worker.core.terminal_text import shown_id


class NotEmbeddings(ValueError):
    """The results hold something other than embeddings of one size."""


def _vector(value: Any) -> list[float]:
    if isinstance(value, str):  # encoding_format base64: little-endian float32
        raw = base64.b64decode(value)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return value


def write_embeddings_parquet(lines: Iterable[bytes], out: Target, rows_per_group: int = ROWS_PER_GROUP) -> int:
    """Write the embeddings of a results file's ``lines`` to ``out``; the number of vectors.
    A path gets the whole file or nothing (``parquet_file.write_whole``)."""
    return write_whole(out, lambda target: _write(lines, target, rows_per_group))


def _write(lines: Iterable[bytes], out: str | BinaryIO, rows_per_group: int) -> int:
    import pyarrow as pa

    writer: RowGroupWriter | None = None
    dim = 0
    count = 0
    try:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            which = f"line {number} ({shown_id(record.get('custom_id'))})"
            body = ((record.get("response") or {}).get("body")) or {}
            if body.get("object") != "list":
                raise NotEmbeddings(f"{which} is not an embeddings response")
            for item in body["data"]:
                vec = _vector(item["embedding"])
                if writer is None:
                    dim = len(vec)
                    schema = pa.schema(
                        [("custom_id", pa.string()), ("index", pa.int32()), ("embedding", pa.list_(pa.float32(), dim))]
                    )
                    writer = RowGroupWriter(out, schema, rows_per_group)
                if len(vec) != dim:
                    raise NotEmbeddings(
                        f"{which} has vectors of {len(vec)} dimensions, the "
                        f"first had {dim}: a fixed-size column needs one size (export lines of one dimensions)"
                    )
                writer.append({"custom_id": record["custom_id"], "index": item["index"], "embedding": vec})
                count += 1
        if writer is None:
            raise NotEmbeddings("the results hold no embeddings")
    finally:
        if writer is not None:
            writer.close()
    return count
