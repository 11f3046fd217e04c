"""A job's valid lines sorted by prefix signature, stable, in bounded memory.

Records are kept in memory until they hold ``memory_bytes``; beyond that each full buffer is
sorted and written to a temporary run file, and ``sorted_records`` merges the runs (and what
is still in memory) with a heap: memory stays at one buffer plus one record per run. The sort
key is the signature's digests and then the input line, so lines of one group keep their
input order and the result does not depend on where the buffers were cut.
"""

from __future__ import annotations

import heapq
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from conveyor.worker.batchio.prefix_signature import SIGNATURE_BYTES

_HEADER = struct.Struct(f">{SIGNATURE_BYTES}sQII")  # digests, line, text length, payload length
_RECORD_OVERHEAD = 120  # a tuple and its objects in memory, beyond the payload's bytes


@dataclass(frozen=True)
class SortRecord:
    digests: bytes
    line: int
    text_length: int  # the canonical prompt's bytes (for the shared-prefix estimate)
    payload: bytes  # the shard file's line


class PrefixSorter:
    """Add records in input order, then read them back once, sorted (see the module)."""

    def __init__(self, memory_bytes: int, temp_dir: str | None = None) -> None:
        self._limit = memory_bytes
        self._buffer: list[SortRecord] = []
        self._held = 0
        self._runs: list[BinaryIO] = []
        self._temp_dir = temp_dir
        self.count = 0

    @property
    def spilled_runs(self) -> int:
        return len(self._runs)

    def add(self, record: SortRecord) -> None:
        self._buffer.append(record)
        self._held += len(record.payload) + _RECORD_OVERHEAD
        self.count += 1
        if self._held >= self._limit:
            self._spill()

    def _spill(self) -> None:
        self._buffer.sort(key=_key)
        run = tempfile.TemporaryFile(dir=self._temp_dir)  # noqa: SIM115 (kept open until the merge; closed by close())
        for rec in self._buffer:
            run.write(_HEADER.pack(rec.digests, rec.line, rec.text_length, len(rec.payload)))
            run.write(rec.payload)
        run.flush()
        run.seek(0)
        self._runs.append(run)
        self._buffer, self._held = [], 0

    def sorted_records(self) -> Iterator[SortRecord]:
        self._buffer.sort(key=_key)
        if not self._runs:
            yield from self._buffer
            return
        streams = [_read_run(run) for run in self._runs]
        yield from heapq.merge(iter(self._buffer), *streams, key=_key)

    def close(self) -> None:
        for run in self._runs:
            run.close()
        self._runs, self._buffer = [], []


def _key(rec: SortRecord) -> tuple[bytes, int]:
    return rec.digests, rec.line


def _read_run(run: BinaryIO) -> Iterator[SortRecord]:
    while header := run.read(_HEADER.size):
        digests, line, text_length, size = _HEADER.unpack(header)
        yield SortRecord(digests, line, text_length, run.read(size))
