"""Shards cut from sorted lines at group boundaries.

The lines come sorted by prefix signature (``conveyor.worker.jobs.prefix_sort``). Between two
neighbours, the link is how many signature depths they share. A shard of target size ``S``
ends where the link is weakest among the cut points that keep it within ``S/2`` to ``3S/2``
lines (nearest to ``S`` between equals), so a group of lines sharing a prefix stays in one
shard when it fits, and a large group becomes consecutive shards. At most ``2S`` lines are
held: enough to see every allowed cut point and still leave the next shard ``S/2``. Only a
job with fewer than ``S/2`` valid lines has a smaller shard.

A shard's group key names the deepest prefix all its lines share (None when they share not
even the first depth): the consecutive shards of one large group share it, and a worker
that has just served one prefers another with the same key (``conveyor.worker.jobs.shard_choice``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from conveyor.worker.batchio.prefix_signature import DEPTHS, DIGEST_BYTES, shared_bytes, shared_levels
from conveyor.worker.jobs.prefix_sort import SortRecord


@dataclass
class CutShard:
    records: list[SortRecord]
    group_key: str | None


@dataclass
class PrefixEstimate:
    """What intake learnt of the job's prompts: their canonical bytes, and the bytes each
    line shares with its neighbour in sorted order (an estimate of what a prefix cache
    saves when each shared prefix is computed once)."""

    prompt_bytes: int = 0
    shared_prefix_bytes: int = 0

    def to_json(self) -> dict[str, int]:
        return {"prompt_bytes": self.prompt_bytes, "shared_prefix_bytes": self.shared_prefix_bytes}


def bounds(size: int) -> tuple[int, int]:
    """The fewest and most lines of a shard of target ``size`` (but a job's only shard)."""
    return (size + 1) // 2, (3 * size) // 2


def cut_shards(records: Iterable[SortRecord], size: int, estimate: PrefixEstimate | None = None) -> Iterator[CutShard]:
    """Shards of ``records`` (sorted) of about ``size`` lines each, cut at group boundaries."""
    low, high = bounds(size)
    buf: list[SortRecord] = []
    links: list[int] = []  # links[i]: depths buf[i - 1] and buf[i] share (links[0]: unused)
    prev: SortRecord | None = None
    for rec in records:
        level = 0 if prev is None else shared_levels(prev.digests, rec.digests)
        if estimate is not None:
            estimate.prompt_bytes += rec.text_length
            if prev is not None:
                estimate.shared_prefix_bytes += shared_bytes(level, prev.text_length, rec.text_length)
        buf.append(rec)
        links.append(level)
        prev = rec
        if len(buf) >= 2 * size:
            cut = _cut_point(links, low, high, size)
            yield _shard(buf[:cut], links[:cut])
            del buf[:cut], links[:cut]
    while len(buf) > high:
        cut = _cut_point(links, low, len(buf) - low, size)
        yield _shard(buf[:cut], links[:cut])
        del buf[:cut], links[:cut]
    if buf:
        yield _shard(buf, links)


def _cut_point(links: list[int], low: int, high: int, size: int) -> int:
    """The index in ``[low, high]`` to cut before: the weakest link, nearest to ``size``."""
    return min(range(low, high + 1), key=lambda i: (links[i], abs(i - size), i))


def _shard(records: list[SortRecord], links: list[int]) -> CutShard:
    level = min(links[1:], default=len(DEPTHS))
    if level == 0:
        return CutShard(records, None)
    digest = records[0].digests[(level - 1) * DIGEST_BYTES : level * DIGEST_BYTES]
    return CutShard(records, digest.hex())
