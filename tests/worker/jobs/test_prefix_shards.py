"""Shards cut by shared prefix: the sort in bounded memory, the cut at group boundaries and
intake's shard files (property tests with hypothesis)."""

from __future__ import annotations

import io
import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.prefix_shapes import many_questions
from conveyor.worker.batchio.prefix_signature import grouping_key, signature_of_text
from conveyor.worker.batchio.records import InputFormat
from conveyor.worker.core.limits import InputLimits
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.intake import Grouping, ingest
from conveyor.worker.jobs.prefix_sort import PrefixSorter, SortRecord
from conveyor.worker.jobs.shard_cut import PrefixEstimate, bounds, cut_shards
from conveyor.worker.store.objects.local import LocalStore
from tests.worker.helpers import jsonl, read_object

KEY = grouping_key("job:test", "m")


def _records(groups: list[int], seed: int) -> list[SortRecord]:
    """One record per line: lines of a group share a 2 KiB prefix and differ after it; the
    lines are shuffled, numbered in that order."""
    texts = [f"group {g:05d} ".encode() * 200 + f"line {i}".encode() for g, n in enumerate(groups) for i in range(n)]
    random.Random(seed).shuffle(texts)
    out = []
    for line, text in enumerate(texts, start=1):
        sig = signature_of_text(text, KEY)
        out.append(SortRecord(sig.digests, line, sig.length, text))
    return out


def _group_of(rec: SortRecord) -> bytes:
    return rec.payload[:11]


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    size=st.integers(1, 24),
    memory=st.sampled_from([1, 3000, 1 << 30]),
    seed=st.integers(0, 1000),
)
def test_every_line_in_exactly_one_shard_within_bounds_small_groups_kept_whole(
    groups: list[int], size: int, memory: int, seed: int
) -> None:
    records = _records(groups, seed)
    sorter = PrefixSorter(memory)
    for rec in records:
        sorter.add(rec)
    if memory == 1:  # every record spilled: a merge of one-record runs
        assert sorter.spilled_runs == len(records)
    try:
        ordered = list(sorter.sorted_records())
    finally:
        sorter.close()
    # The same order whether or not it spilled to runs: signature, then input line (stable).
    assert ordered == sorted(records, key=lambda r: (r.digests, r.line))
    shards = list(cut_shards(ordered, size))
    assert [r for s in shards for r in s.records] == ordered  # each line once, in sorted order
    low, high = bounds(size)
    sizes = [len(s.records) for s in shards]
    if len(records) >= low:
        assert all(low <= n <= high for n in sizes), sizes
    else:
        assert sizes == [len(records)]
    if max(groups) <= size // 2:  # a boundary lies in every window of allowed cuts: no group is split
        first_shard: dict[bytes, int] = {}
        for index, shard in enumerate(shards):
            for rec in shard.records:
                assert first_shard.setdefault(_group_of(rec), index) == index
    for shard in shards:  # a shard whose lines all share a group names it
        if len({_group_of(r) for r in shard.records}) == 1:
            assert shard.group_key is not None


def test_a_large_group_is_consecutive_shards_sharing_one_key() -> None:
    shards = list(cut_shards(sorted(_records([5, 100, 5], 1), key=lambda r: (r.digests, r.line)), 10))
    keyed: dict[str | None, list[int]] = {}
    for index, shard in enumerate(shards):
        keyed.setdefault(shard.group_key, []).append(index)
    big = max(keyed.values(), key=len)
    assert len(big) >= 8 and big == list(range(big[0], big[0] + len(big)))


def test_the_estimate_counts_each_shared_prefix_once() -> None:
    estimate = PrefixEstimate()
    records = sorted(_records([10, 10], 3), key=lambda r: (r.digests, r.line))
    list(cut_shards(records, 8, estimate))
    assert estimate.prompt_bytes == sum(r.text_length for r in records)
    # 18 of 20 lines share a 2.4 KB prefix with the line before; the signature knows 2 KiB of it
    # (4 KiB is past both texts' ends).
    assert estimate.shared_prefix_bytes == 18 * 2048


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), size=st.integers(2, 12), bad_every=st.integers(3, 9))
def test_intake_groups_valid_lines_and_reports_invalid_ones_by_line(
    tmp_path_factory, seed: int, size: int, bad_every: int
) -> None:
    shape = many_questions(6, 5, 600, shuffled=True, seed=seed)
    rows: list = []
    valid_lines: dict[str, int] = {}
    bad_lines = []
    for line in shape.lines:
        if len(rows) % bad_every == bad_every - 1:
            rows.append(b"{broken")
            bad_lines.append(len(rows))
        rows.append(line)
        valid_lines[line["custom_id"]] = len(rows)
    store = LocalStore(tmp_path_factory.mktemp("objects"))
    result = ingest(
        io.BytesIO(jsonl(rows)), store, "batch_x", limits=InputLimits(), input_format=InputFormat.jsonl,
        shard_size=size, max_shards=10_000, grouping=Grouping(KEY, memory_bytes=4096),
    )  # fmt: skip
    assert result.total == len(rows) and result.invalid == len(bad_lines)
    seen: dict[str, int] = {}
    low, high = bounds(size)
    for plan in result.shards:
        shard_lines = [json.loads(x) for x in read_object(store, object_keys.shard_input_key(plan.index)).splitlines()]
        assert plan.num_items == len(shard_lines)
        assert low <= plan.num_items <= high or len(result.shards) == 1
        assert (plan.first_line, plan.last_line) == (
            min(r["line"] for r in shard_lines),
            max(r["line"] for r in shard_lines),
        )
        for r in shard_lines:
            assert r["custom_id"] not in seen
            seen[r["custom_id"]] = r["line"]
    assert seen == valid_lines
    invalid = [json.loads(x)["error"]["line"] for x in read_object(store, object_keys.INVALID).splitlines()]
    assert invalid == bad_lines
    # Each document's 5 questions share one shard when a shard may hold twice that.
    if size >= 10:
        doc_shard: dict[str, int] = {}
        for plan in result.shards:
            for x in read_object(store, object_keys.shard_input_key(plan.index)).splitlines():
                doc = json.loads(x)["messages"][1]["content"].split(":")[0]
                assert doc_shard.setdefault(doc, plan.index) == plan.index
    assert result.prefix is not None and 0 < result.prefix.shared_prefix_bytes < result.prefix.prompt_bytes


def test_intake_puts_rerank_lines_that_share_a_query_in_one_shard(tmp_path_factory) -> None:
    queries = [f"query {q}: " + f"what does guest {q} order? " * 30 for q in range(4)]
    rows = [
        {
            "custom_id": f"q{q}-{i}",
            "method": "POST",
            "url": "/v1/rerank",
            "body": {"query": queries[q], "documents": [f"document {i}", "soup"], "top_n": 1},
        }
        for q in range(4)
        for i in range(5)
    ]
    random.Random(7).shuffle(rows)
    store = LocalStore(tmp_path_factory.mktemp("objects"))
    result = ingest(
        io.BytesIO(jsonl(rows)), store, "batch_r", limits=InputLimits(), input_format=InputFormat.jsonl,
        shard_size=10, max_shards=10_000, grouping=Grouping(KEY, memory_bytes=4096),
    )  # fmt: skip
    shard_of: dict[str, int] = {}
    for plan in result.shards:
        for x in read_object(store, object_keys.shard_input_key(plan.index)).splitlines():
            record = json.loads(x)
            query = record["pairs"][0][0]
            assert record["rerank"] == {"top_n": 1, "return_documents": True}
            assert shard_of.setdefault(query, plan.index) == plan.index
    assert sorted(shard_of) == sorted(queries) and len(set(shard_of.values())) >= 2
