"""Prefix caching: exact outputs on cache hits, shared prefixes computed once, the prefix-aware
policy, and the block pool's invariants under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from conveyor.engine.core.request import Request
from conveyor.engine.memory.kv_cache import KVCacheManager
from conveyor.kernels.utils import cdiv
from tests.engine.helpers import assert_no_leaks, model_case
from tests.engine.reference import assert_outputs_match

SYSTEM = "Seven guests wait at the table and the waiter pours cold water while the kitchen"
SUFFIXES = [" bakes bread", " serves soup and fish", " is slow", " counts one two three four", "", " rests"]


def _greedy(n, ignore_eos=True):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos)


# (gpt_neox and granite run through the transformers fallback)
@pytest.mark.parametrize(
    "family",
    [
        *("qwen3", "phi3-longrope", "mixtral", "qwen3_moe", "gemma2", "gemma3", "glm4_moe", "gemma4"),
        *("gemma4-moe", "mistral-window", "gpt_oss", "smollm3", "olmo3", "deepseek_v3", "gpt_neox"),
        *("granite",),
    ],
)
def test_cache_hits_keep_outputs_exact(family, tiny_models, hf_reference, make_llm):
    path, kwargs = model_case(tiny_models, family)
    hf = hf_reference(path)
    llm = make_llm(path, block_size=4, **kwargs)
    prompts = [SYSTEM + s for s in SUFFIXES]
    first = llm.generate(prompts[:2], _greedy(20, ignore_eos=False))  # warms the cache with the shared prefix
    second = llm.generate(prompts, _greedy(20, ignore_eos=False))  # partial-block sharing and identical prompts
    assert_outputs_match(hf, prompts[:2] + prompts, [20] * 8, first + second)
    system_blocks = len(hf.encode(SYSTEM)) // 4
    assert all(o.num_cached_tokens >= (system_blocks - 1) * 4 for o in second)
    # The identical prompts hit every full block but the one holding the last token.
    for p, o in zip(prompts[:2], second[:2], strict=True):
        assert o.num_cached_tokens == (len(hf.encode(p)) - 1) // 4 * 4
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and 0 < stats.prefix_cache_hit_rate < 1


def test_cache_salts_separate_the_prefix_cache_and_equal_salts_share_it(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama")
    hf = hf_reference(path)
    llm = make_llm(path, block_size=4)
    first, second = SYSTEM + SUFFIXES[0], SYSTEM + SUFFIXES[1]
    runs = [  # one at a time, in this order
        (first, "tenant-a"), (first, "tenant-b"), (first, None),  # another salt, and none, find nothing
        (first, "tenant-a"), (second, "tenant-a"), (second, "tenant-b"),  # each salt finds its own
    ]  # fmt: skip
    outs = []
    for prompt, salt in runs:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, cache_salt=salt)
        outs += llm.generate([prompt], params)
    whole = (len(hf.encode(first)) - 1) // 4 * 4  # every full block but the one holding the last token
    system = len(hf.encode(SYSTEM)) // 4 * 4 - 4  # the system prompt's full blocks, but the one it ends in
    cached = [o.num_cached_tokens for o in outs]
    assert cached[:4] == [0, 0, 0, whole]
    assert cached[4] >= system and cached[5] >= system  # tenant-b's own earlier run of ``first``
    assert_outputs_match(hf, [p for p, _ in runs], [12] * len(runs), outs)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="")


def test_eviction_under_memory_pressure_keeps_outputs_exact(tiny_models, hf_reference, make_llm):
    path = tiny_models("llama")
    hf = hf_reference(path)
    llm = make_llm(path, block_size=4, num_kv_blocks=24)
    prompts = [SYSTEM + s for s in SUFFIXES] + [f"Tea {i} and cake with the chef number {i}" for i in range(6)]
    for _ in range(2):
        outs = llm.generate(prompts, _greedy(24, ignore_eos=False))
        assert_outputs_match(hf, prompts, [24] * len(prompts), outs)
    stats = llm.engine.stats()
    assert stats.num_evictions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.parametrize("policy", ["fcfs", "prefix"])
@pytest.mark.parametrize("budget", [8192, 16])
def test_a_shared_uncached_prefix_is_computed_once(policy, budget, tiny_models):
    engine = LLMEngine(
        EngineConfig(
            tiny_models("llama"), device="cpu", block_size=4, scheduling_policy=policy, max_num_batched_tokens=budget
        )
    )
    prefix = list(range(10, 74))  # 64 tokens = 16 full blocks
    prompts = [[*prefix, 100 + i, 200 + i, 300 + i] for i in range(8)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, _greedy(3))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    computed = engine.stats().num_prompt_tokens_computed
    # 64 shared tokens once, then each request's own 3 tokens; nothing near 8 x 67.
    assert computed == 64 + 8 * 3
    assert sorted(o.num_cached_tokens for o in outs.values()) == [0] + [64] * 7
    assert_no_leaks(engine)


def test_n_samples_share_the_prompt_blocks(tiny_models):
    engine = LLMEngine(EngineConfig(tiny_models("llama"), device="cpu", block_size=8))
    prompt = list(range(10, 50))  # 40 tokens: 5 full blocks
    engine.add_request("x", prompt, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    assert sorted(o.num_cached_tokens for o in outs) == [0, 32, 32, 32]
    assert engine.stats().num_prompt_tokens_computed == 40 + 3 * 8
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different samples
    assert_no_leaks(engine)


def test_prefix_policy_runs_requests_sharing_a_prefix_together(tiny_models):
    order = {}
    for policy in ("fcfs", "prefix"):
        engine = LLMEngine(
            EngineConfig(tiny_models("llama"), device="cpu", block_size=4, max_num_seqs=1, scheduling_policy=policy)
        )
        a, b = list(range(10, 30)), list(range(40, 60))
        for i in range(3):
            engine.add_request(f"a{i}", [*a, 100 + i], _greedy(2))
            engine.add_request(f"b{i}", [*b, 100 + i], _greedy(2))
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step() if o.finished]
        order[policy] = finished
        assert_no_leaks(engine)
    assert order["fcfs"] == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert order["prefix"] == ["a0", "a1", "a2", "b0", "b1", "b2"]


# ---- property-based: the block pool stays consistent under any sequence of operations ----

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # few symbols: many shared prefixes


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=12, block_size=2, enable_caching=True)
        self.live: dict[str, Request] = {}
        self.seq = 0

    @rule(tokens=TOKENS)
    def admit(self, tokens):
        self.seq += 1
        req = Request(
            f"r{self.seq}",
            tokens,
            SamplingParams(),
            max_total_tokens=10_000,
            eos_token_ids=frozenset(),
            arrival_seq=self.seq,
        )
        hits, cached = self.kv.get_computed_blocks(req)
        assert cached <= len(tokens) - 1
        assert [b.block_hash for b in hits] == req.block_hashes[: len(hits)]
        if self.kv.allocate_slots(req, len(tokens) - cached, hits):
            req.num_computed_tokens = len(tokens)
            self.live[req.request_id] = req
        else:
            assert req.request_id not in self.kv._blocks

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def grow(self, data, token):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.append_token(token)
        if self.kv.allocate_slots(req, 1):
            req.num_computed_tokens += 1
        else:  # what the scheduler does when it cannot grow: preempt (free) the request
            self.kv.free(req)
            del self.live[req.request_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))

    @invariant()
    def consistent(self):
        kv, pool = self.kv, self.kv.pool
        refs = [0] * kv.num_blocks
        for rid, req in self.live.items():
            ids = kv.block_ids(rid)
            assert len(ids) == len(set(ids)) == cdiv(req.num_computed_tokens, kv.block_size)
            for i in ids:
                refs[i] += 1
        assert [b.ref_cnt for b in pool.blocks] == refs
        free = pool.free_queue.block_ids()
        assert sorted(free) == [i for i, r in enumerate(refs) if r == 0]
        assert pool.num_free_blocks == len(free)
        for block_hash, block in pool.cached.items():
            assert block.block_hash == block_hash
        for rid, req in self.live.items():  # every registered block of a request holds its tokens' hash
            for i, bid in enumerate(kv.block_ids(rid)[: req.num_computed_tokens // kv.block_size]):
                h = pool.blocks[bid].block_hash
                assert h is None or h == req.block_hashes[i]

    def teardown(self):
        for req in self.live.values():
            self.kv.free(req)
        assert self.kv.num_free_blocks == self.kv.num_blocks


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
