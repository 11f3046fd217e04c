"""The block pool and block tables: on-demand allocation, freeing, prefix hits, LRU eviction;
and proof that the engine really reads its paged cache."""

from __future__ import annotations

import pytest

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from conveyor.engine.memory.kv_cache import KVCacheManager
from tests.engine.helpers import assert_no_leaks, make_request


def test_blocks_are_allocated_on_demand_and_freed():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    r = make_request(1, tokens=list(range(10)), max_tokens=16)
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_ids("r1")) == 3 and kv.num_free_blocks == 5
    r.num_computed_tokens = 10
    r.append_token(99)
    assert kv.allocate_slots(r, 1)  # token 11 still fits in the third block
    assert len(kv.block_ids("r1")) == 3
    r.num_computed_tokens = 11
    r.append_token(98)
    r.append_token(97)
    assert kv.allocate_slots(r, 2)  # tokens 12-13: a fourth block
    assert len(kv.block_ids("r1")) == 4 and kv.num_free_blocks == 4
    kv.free(r)
    assert kv.num_free_blocks == 8 and kv.block_ids("r1") == []


def test_blocks_out_of_a_window_are_released_and_the_table_keeps_its_indexing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    r = make_request(1, tokens=list(range(14)), max_tokens=16)
    assert kv.allocate_slots(r, 14)
    table = kv.block_ids("r1")
    assert len(table) == 4 and kv.num_free_blocks == 4
    r.num_computed_tokens = 14
    # The next query sits at 14 and sees keys 9..14 with a window of 6: blocks 0 and 1 (keys 0-7) go.
    assert kv.free_outside_window(r, 6) == 2
    assert kv.num_free_blocks == 6 and kv.block_ids("r1") == table
    assert kv.free_outside_window(r, 6) == 0  # nothing more until the window moves on
    r.append_token(99)
    assert kv.allocate_slots(r, 1)
    r.num_computed_tokens = 15
    assert kv.free_outside_window(r, 6) == 0  # keys 10.. still reach block 2 (8-11)
    assert kv.free_outside_window(r, 100) == 0
    kv.free(r)  # the rest, each block once
    assert kv.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_allocation_fails_cleanly_when_short():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    r = make_request(1, tokens=list(range(20)), max_tokens=16)
    assert not kv.allocate_slots(r, 20)
    assert kv.num_free_blocks == 4 and kv.block_ids("r1") == []
    assert kv.allocate_slots(r, 12, reserve_blocks=1)
    assert not kv.allocate_slots(make_request(2, tokens=[1, 2, 3], max_tokens=16), 3, reserve_blocks=1)


def test_prefix_hit_shares_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True, namespace="m")
    a = make_request(1, tokens=list(range(12)), max_tokens=16)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 12)
    b = make_request(2, tokens=[*range(10), 50, 51, 52], max_tokens=16)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == kv.block_ids("r1")[:2]
    assert kv.allocate_slots(b, 13 - 8, hits)
    assert kv.block_ids("r2")[:2] == kv.block_ids("r1")[:2]
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("r1")] == [2, 2, 1]
    # An identical prompt: all 3 blocks are cached, but the last token must be computed.
    c = make_request(3, tokens=list(range(12)), max_tokens=16)
    hits, n = kv.get_computed_blocks(c)
    assert n == 8
    assert kv.stats.queries == 12 + 13 and kv.stats.hits == 8


def test_namespaces_never_share():
    pool_a = KVCacheManager(num_blocks=8, block_size=4, namespace="model-a")
    pool_b = KVCacheManager(num_blocks=8, block_size=4, namespace="model-b")
    ra, rb = (
        make_request(1, tokens=list(range(9)), max_tokens=16),
        make_request(2, tokens=list(range(9)), max_tokens=16),
    )
    pool_a.get_computed_blocks(ra)
    pool_b.get_computed_blocks(rb)
    assert ra.block_hashes and set(ra.block_hashes).isdisjoint(rb.block_hashes)


def test_freed_cached_blocks_stay_findable_then_evict_in_lru_order_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_caching=True)
    a = make_request(1, tokens=[1, 2, 3, 4, 5, 6, 7], max_tokens=16)
    assert kv.allocate_slots(a, 7)
    a_blocks = kv.block_ids("r1")
    kv.free(a)
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 3
    # Still findable after being freed.
    again = make_request(2, tokens=[1, 2, 3, 4, 5, 6, 0], max_tokens=16)
    hits, n = kv.get_computed_blocks(again)
    assert n == 6
    # Fresh allocations take never-used blocks first, then the freed ones, the chain's tail first.
    order = kv.pool.free_queue.block_ids()
    assert len(a_blocks) == 4  # 3 full blocks and a partial one
    assert order == [b for b in range(6) if b not in a_blocks] + a_blocks[::-1]
    hog = make_request(3, tokens=list(range(100, 110)), max_tokens=16)
    assert kv.allocate_slots(hog, 10)  # 5 blocks: 2 never used, the partial one, then 2 cached
    assert kv.pool.num_evictions == 2
    hits, n = kv.get_computed_blocks(make_request(4, tokens=[1, 2, 3, 4, 5, 6, 0], max_tokens=16))
    assert n == 2 and hits[0].block_id == a_blocks[0]  # the head of the chain is the last to go
    kv.free(hog)


def test_request_too_long_for_the_cache_is_rejected(tiny_models):
    engine = LLMEngine(EngineConfig(tiny_models("llama"), device="cpu", block_size=4, num_kv_blocks=8))
    with pytest.raises(ValueError, match=r"prompt is .* tokens; this engine takes at most 31"):
        engine.add_request("long", list(range(3, 40)), SamplingParams(max_tokens=4))
    engine.add_request("ok", list(range(3, 20)), SamplingParams(max_tokens=100, temperature=0))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    # A request stops when it fills the whole cache instead of crashing the engine.
    assert outs[0].finish_reason == "length" and len(outs[0].prompt_token_ids) + len(outs[0].token_ids) == 32
    assert_no_leaks(engine)


def _run(engine: LLMEngine, corrupt=None) -> list[int]:
    engine.add_request(
        "x", "Seven guests wait at the table and the waiter pours", SamplingParams(max_tokens=12, temperature=0)
    )
    out = engine.step()  # the prefill
    if corrupt is not None:
        corrupt(engine)
    tokens = list(out[0].new_token_ids)
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
    return tokens


def test_corrupting_a_cached_block_changes_the_output_and_other_blocks_do_not(tiny_models):
    engine = LLMEngine(
        EngineConfig(tiny_models("llama"), device="cpu", block_size=4, num_kv_blocks=32, enable_prefix_caching=False)
    )
    clean = _run(engine)

    def corrupt_own_block(e):
        block = e.kv.block_ids(e._groups["x"][0].seq_id)[1]
        e.runner.kv_cache[:, :, block].normal_()

    def corrupt_unused_block(e):
        used = set(e.kv.block_ids(e._groups["x"][0].seq_id))
        free = next(b for b in range(e.kv.num_blocks) if b not in used)
        e.runner.kv_cache[:, :, free].normal_()

    assert _run(engine, corrupt_unused_block) == clean
    assert _run(engine, corrupt_own_block) != clean
    assert_no_leaks(engine)
