"""One step's batch as rank 0's ``ModelRunner`` builds it, packed into one int64 tensor for
the broadcast to the other ranks (one packed tensor beats pickled objects), and its header:
the sizes the receivers need to allocate it, sent ahead through each rank's doorbell pipe."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

RUN, STOP = 1, 2
# command, tokens, requests, blocks per table, decodes, sampled rows
_HEADER = struct.Struct("<6q")


@dataclass
class StepInputs:
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    tables: list[list[int]]  # one block table per request (padded with block 0 when packed)
    num_decodes: int
    sample_rows: list[int]  # the rows whose logits are sampled

    def header(self) -> bytes:
        max_blocks = max(len(t) for t in self.tables)
        return _HEADER.pack(
            RUN, len(self.input_ids), len(self.seq_lens), max_blocks, self.num_decodes, len(self.sample_rows)
        )

    def pack(self, device: torch.device) -> torch.Tensor:
        max_blocks = max(len(t) for t in self.tables)
        flat: list[int] = [*self.input_ids, *self.positions, *self.slots, *self.seq_lens, *self.query_lens]
        for table in self.tables:
            flat.extend(table)
            flat.extend([0] * (max_blocks - len(table)))
        flat.extend(self.sample_rows)
        return torch.tensor(flat, dtype=torch.int64, device=device)


def stop_header() -> bytes:
    return _HEADER.pack(STOP, 0, 0, 0, 0, 0)


def is_stop(header: bytes) -> bool:
    return _HEADER.unpack(header)[0] == STOP


def payload_size(header: bytes) -> int:
    _, tokens, requests, max_blocks, _, rows = _HEADER.unpack(header)
    return 3 * tokens + 2 * requests + requests * max_blocks + rows


def unpack(header: bytes, payload: torch.Tensor) -> StepInputs:
    _, tokens, requests, max_blocks, num_decodes, rows = _HEADER.unpack(header)
    flat = payload.tolist()
    cuts = [tokens, tokens, tokens, requests, requests, requests * max_blocks, rows]
    parts, start = [], 0
    for size in cuts:
        parts.append(flat[start : start + size])
        start += size
    ids, positions, slots, seq_lens, query_lens, tables, sample_rows = parts
    return StepInputs(
        input_ids=ids,
        positions=positions,
        slots=slots,
        seq_lens=seq_lens,
        query_lens=query_lens,
        tables=[tables[i * max_blocks : (i + 1) * max_blocks] for i in range(requests)],
        num_decodes=num_decodes,
        sample_rows=sample_rows,
    )
