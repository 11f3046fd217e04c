"""``conveyor results --format parquet``'s writer: a whole file or none, and ids shown escaped."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow.parquet as pq
import pytest

from conveyor.worker.batchio.embeddings_parquet import NotEmbeddings, write_embeddings_parquet


def _line(custom_id: str, dim: int) -> bytes:
    body = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5] * dim}]}
    return json.dumps({"custom_id": custom_id, "response": {"status_code": 200, "body": body}}).encode() + b"\n"


def test_a_complete_export_is_renamed_into_place(tmp_path) -> None:
    out = tmp_path / "vectors.parquet"
    assert write_embeddings_parquet([_line(f"e-{i}", 4) for i in range(5)], out, rows_per_group=2) == 5
    assert pq.read_table(out).column("custom_id").to_pylist() == [f"e-{i}" for i in range(5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vectors.parquet"]


def test_an_export_that_fails_midway_leaves_no_file(tmp_path) -> None:
    out = tmp_path / "vectors.parquet"
    lines = [_line(f"e-{i}", 4) for i in range(4)] + [_line("\x1b]0;owned\x07", 8)]
    with pytest.raises(NotEmbeddings, match=r"line 5 \('\\x1b\]0;owned\\x07'\) has vectors of 8 dimensions"):
        write_embeddings_parquet(lines, out, rows_per_group=2)  # two row groups written first
    assert list(tmp_path.iterdir()) == []


def test_a_write_error_leaves_no_file_and_an_old_export_stays(tmp_path) -> None:
    out = tmp_path / "vectors.parquet"
    write_embeddings_parquet([_line("old", 4)], out)

    def lines() -> Iterator[bytes]:
        for i in range(3):
            yield _line(f"e-{i}", 4)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_embeddings_parquet(lines(), out, rows_per_group=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vectors.parquet"]
    assert pq.read_table(out).column("custom_id").to_pylist() == ["old"]
