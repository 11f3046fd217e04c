"""``HybridMemory``: state slots taken on admission, given back on finish, abort and
preemption, admission waiting for a slot, and the slot found from the first KV block."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.core.request import RequestStatus
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.memory.state_cache import LinearStateCache
from conveyor.engine.memory.state_memory import HybridMemory, make_request_memory
from conveyor.engine.models.hybrid_config import LinearAttentionSpec
from tests.engine.helpers import make_request, step_without_model

LIN = LinearAttentionSpec(
    linear_layers=(True, False), conv_kernel=4, num_k_heads=1, num_v_heads=2, k_head_dim=4, v_head_dim=4
)


def _memory(num_slots: int, num_blocks: int = 64) -> HybridMemory:
    state = LinearStateCache.allocate(LIN, num_slots, num_blocks, torch.float32, torch.device("cpu"))
    return HybridMemory(num_blocks, 4, enable_caching=False, state=state)


def _assert_all_free(mem: HybridMemory) -> None:
    assert mem.state is not None
    assert mem.num_free_state_slots == mem.state.num_slots
    assert bool((mem.state.slot_of_block == -1).all())
    assert mem.num_free_blocks == mem.num_blocks


def test_admission_waits_for_a_free_state_slot():
    mem = _memory(num_slots=2)
    sched = Scheduler(mem, max_num_seqs=8, max_num_batched_tokens=256)
    reqs = [make_request(i, 6, max_tokens=3) for i in range(5)]
    for req in reqs:
        sched.add_request(req)
    most_running, done = 0, []
    while sched.has_unfinished():
        _, finished = step_without_model(sched)
        most_running = max(most_running, len(sched.running))
        done += finished
        assert mem.state is not None
        for req in sched.running:  # the first block of each running request names its slot
            slot = mem.state_slot(req.seq_id)
            assert slot is not None and int(mem.state.slot_of_block[mem.block_ids(req.seq_id)[0]]) == slot
    assert most_running == 2  # the slots, not max_num_seqs, bounded the batch
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs)
    _assert_all_free(mem)


def test_preemption_and_abort_give_the_slot_back():
    mem = _memory(num_slots=4, num_blocks=7)  # 7 blocks of 4 tokens: the second request gets preempted
    sched = Scheduler(mem, max_num_seqs=4, max_num_batched_tokens=256)
    a, b = make_request(0, 9, max_tokens=12), make_request(1, 9, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(40):
        step_without_model(sched)
        if sched.num_preemptions:
            break
    assert mem.state_slot(b.seq_id) is None and mem.num_free_state_slots == 3
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    while sched.has_unfinished():
        step_without_model(sched)
    _assert_all_free(mem)


def test_prefix_caching_is_off_and_speculation_needs_snapshots():
    state = LinearStateCache.allocate(LIN, 2, 8, torch.float32, torch.device("cpu"))
    mem = make_request_memory(state, speculative=False, enable_caching=True, num_blocks=8, block_size=4)
    assert isinstance(mem, HybridMemory) and not mem.enable_caching
    with pytest.raises(ValueError, match="needs state snapshots to roll back"):
        make_request_memory(state, speculative=True, enable_caching=False, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="prefix caching is not served"):
        HybridMemory(8, 4, enable_caching=True, state=state)


def test_trim_rolls_the_slot_back_to_the_snapshot_after_the_last_kept_token():
    state = LinearStateCache.allocate(LIN, 2, 8, torch.float32, torch.device("cpu"), num_snapshots=3)
    mem = make_request_memory(state, speculative=True, enable_caching=False, num_blocks=8, block_size=4)
    assert isinstance(mem, HybridMemory) and state.conv_snapshots is not None and state.recurrent_snapshots is not None
    req = make_request(0, 6, max_tokens=8)
    assert mem.allocate_slots(req, 10)  # 6 prompt tokens, then a verification of 1 + 3 at positions 6..9
    slot = mem.state_slot(req.seq_id)
    assert slot is not None and len(mem.block_ids(req.seq_id)) == 3
    for position in range(6, 9):  # the states after positions 6, 7 and 8, marked by their position
        state.conv_snapshots[:, slot, position % 3] = position
        state.recurrent_snapshots[:, slot, position % 3] = position
    other = 1 - slot
    mem.trim(req, 8)  # two tokens of the step kept: positions 6 and 7
    assert bool((state.conv[:, slot] == 7).all()) and bool((state.recurrent[:, slot] == 7).all())
    assert bool((state.recurrent[:, other] == 0).all())
    assert len(mem.block_ids(req.seq_id)) == 2  # the K/V block only the rejected tokens held is freed
    mem.free(req)
    _assert_all_free(mem)
