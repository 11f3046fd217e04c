from __future__ import annotations

import pytest
import torch

from conveyor.engine import LLM, LLMEngine
from tests.engine.helpers import assert_no_leaks
from tests.engine.reference import HFReference


@pytest.fixture
def make_llm():
    """Build LLMs; at teardown, every one of them must have no request left and all its
    KV blocks back in the free queue with no reference held (no block leaks)."""
    built: list[LLMEngine] = []  # the engines: a test may shut its LLM down, which lets go of it

    def make(model: str, **kwargs) -> LLM:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        llm = LLM(model, **kwargs)
        built.append(llm.engine)
        return llm

    yield make
    for engine in built:
        assert_no_leaks(engine)


@pytest.fixture(scope="session")
def hf_reference():
    cache: dict[str, HFReference] = {}

    def get(model_path: str) -> HFReference:
        if model_path not in cache:
            cache[model_path] = HFReference(model_path)
        return cache[model_path]

    torch.set_num_threads(max(1, torch.get_num_threads()))
    return get
