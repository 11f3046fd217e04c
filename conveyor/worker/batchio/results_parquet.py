"""``conveyor results --format parquet``: a results or errors file as Parquet, vectors for an
embeddings job's results (``embeddings_parquet``), answer rows otherwise (``answers_parquet``).
The first line decides."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass

from conveyor.worker.batchio.answers_parquet import write_answers_parquet
from conveyor.worker.batchio.embeddings_parquet import write_embeddings_parquet
from conveyor.worker.batchio.parquet_file import Target


@dataclass(frozen=True)
class ParquetExport:
    rows: int
    what: str  # "vectors" or "answers"


def write_results_parquet(lines: Iterable[bytes], out: Target) -> ParquetExport:
    stream = iter(lines)
    head: list[bytes] = []
    for line in stream:
        head.append(line)
        if line.strip():
            break
    body = ((json.loads(head[-1]).get("response") or {}).get("body") or {}) if head and head[-1].strip() else {}
    rest = itertools.chain(head, stream)
    data = body.get("data")
    # (a score response is a "list" too, of scores: not vectors)
    if body.get("object") == "list" and not (isinstance(data, list) and data and data[0].get("object") == "score"):
        return ParquetExport(write_embeddings_parquet(rest, out), "vectors")
    return ParquetExport(write_answers_parquet(rest, out), "answers")
