"""``with LLM(...) as llm:`` releases the engine on exit, tensor-parallel ranks included,
and so does dropping the last reference: the process builds the next engine at once, with
no ``shutdown()`` call and no garbage collection in between."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from conveyor.engine import LLM, EngineDeadError
from conveyor.engine.distributed import parallel_state
from conveyor.engine.distributed.rank_group import RankGroup
from tests.engine.reference import greedy

PROMPT = "The chef brings warm bread to the guest"


@contextmanager
def no_garbage_collection() -> Iterator[None]:
    """Only reference counting frees objects inside: what is released is released by us."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def test_the_with_block_releases_the_engine(tiny_models):
    model = tiny_models("llama")
    with LLM(model, device="cpu", dtype="float32") as llm:
        [out] = llm.generate(PROMPT, greedy([4]))
        engine = weakref.ref(llm.engine)
        runner = weakref.ref(llm.engine.runner)
    assert len(out.token_ids) == 4
    assert engine() is None and runner() is None  # weights and KV cache freed with them
    with pytest.raises(EngineDeadError, match="this LLM is shut down"):
        llm.generate(PROMPT, greedy([4]))
    llm.shutdown()  # a second shutdown does nothing


def test_tensor_parallel_ranks_stop_at_the_end_of_the_with_block_and_when_dropped(tiny_models):
    model = tiny_models("llama")
    with no_garbage_collection():
        with LLM(model, device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
            ranks = llm.engine.runner.ranks
            assert isinstance(ranks, RankGroup)
            [proc] = ranks.procs
            [first] = llm.generate(PROMPT, greedy([4]))
        assert proc.exitcode == 0  # told to stop, not killed
        assert not parallel_state.current().enabled
        # A second tensor-parallel engine in the same process, then dropped without shutdown().
        second = LLM(model, device="cpu", dtype="float32", tensor_parallel_size=2)
        [again] = second.generate(PROMPT, greedy([4]))
        ranks = second.engine.runner.ranks
        assert isinstance(ranks, RankGroup)
        [proc] = ranks.procs
        del second
        assert proc.exitcode == 0
        # So the next one starts too.
        with LLM(model, device="cpu", dtype="float32", tensor_parallel_size=2) as third:
            [last] = third.generate(PROMPT, greedy([4]))
    assert first.token_ids == again.token_ids == last.token_ids
