"""A job's embeddings as Parquet (``conveyor results JOB --format parquet``): one row per
vector, ``custom_id``, ``index`` (the input's place in its line) and ``embedding`` (a
fixed-size list of float32), written from the results file's lines as they stream in, a row
group at a time, so memory stays bounded by one row group whatever the job's size."""

from __future__ import annotations

import base64
import json
import os
import struct
from collections.abc import Iterable
from typing import Any, BinaryIO

ROWS_PER_GROUP = 8192


class NotEmbeddings(ValueError):
    """The results hold something other than embeddings of one size."""


def _vector(value: Any) -> list[float]:
    if isinstance(value, str):  # encoding_format base64: little-endian float32
        raw = base64.b64decode(value)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return value


def write_embeddings_parquet(
    lines: Iterable[bytes], out: str | os.PathLike[str] | BinaryIO, rows_per_group: int = ROWS_PER_GROUP
) -> int:
    """Write the embeddings of a results file's ``lines`` to ``out``; the number of vectors."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer: Any = None
    dim = 0
    ids: list[str] = []
    indexes: list[int] = []
    flat: list[float] = []
    count = 0

    def flush() -> None:
        nonlocal ids, indexes, flat
        if not ids:
            return
        values = pa.array(flat, type=pa.float32())
        table = pa.table(
            {
                "custom_id": pa.array(ids, type=pa.string()),
                "index": pa.array(indexes, type=pa.int32()),
                "embedding": pa.FixedSizeListArray.from_arrays(values, dim),
            }
        )
        writer.write_table(table)
        ids, indexes, flat = [], [], []

    try:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            body = ((record.get("response") or {}).get("body")) or {}
            if body.get("object") != "list":
                raise NotEmbeddings(f"line {number} ({record.get('custom_id')}) is not an embeddings response")
            for item in body["data"]:
                vec = _vector(item["embedding"])
                if writer is None:
                    dim = len(vec)
                    schema = pa.schema(
                        [("custom_id", pa.string()), ("index", pa.int32()), ("embedding", pa.list_(pa.float32(), dim))]
                    )
                    writer = pq.ParquetWriter(out, schema)
                if len(vec) != dim:
                    raise NotEmbeddings(
                        f"line {number} ({record.get('custom_id')}) has vectors of {len(vec)} dimensions, the "
                        f"first had {dim}: a fixed-size column needs one size (export lines of one dimensions)"
                    )
                ids.append(record["custom_id"])
                indexes.append(item["index"])
                flat.extend(vec)
                count += 1
                if len(ids) >= rows_per_group:
                    flush()
        if writer is None:
            raise NotEmbeddings("the results hold no embeddings")
        flush()
    finally:
        if writer is not None:
            writer.close()
    return count
