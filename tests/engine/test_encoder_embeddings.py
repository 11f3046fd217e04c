"""Encoder-only embedders (``conveyor.engine.models.bert``: BERT, XLM-RoBERTa) against
sentence-transformers' ``encode`` on tiny random-weight models: CLS and mean pooling,
normalised and not, ``dimensions``, mixed lengths in one step; each input runs whole in one
step with no K/V tensors, one over the step budget is refused, generation is refused."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine import LLM, PoolingParams, SamplingParams
from conveyor.testing.tiny_models import build_tiny_encoder
from tests.engine.embedding_helpers import (
    TEXTS,
    assert_same_vectors,
    reference_vectors,
    sentence_transformers_encoder,
)
from tests.engine.helpers import assert_no_leaks, record_steps

F32 = {"dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def st_root(tmp_path_factory):
    return tmp_path_factory.mktemp("st-encoders")


@pytest.mark.parametrize(
    "family,pooling,normalize,dimensions",
    [
        ("bert", "cls", True, None),
        ("bert", "mean", False, 16),
        ("xlm-roberta", "mean", True, 24),
        ("xlm-roberta", "cls", False, None),
    ],
)
def test_encoder_vectors_equal_sentence_transformers(st_root, monkeypatch, family, pooling, normalize, dimensions):
    path = sentence_transformers_encoder(st_root, family, pooling, normalize)
    llm = LLM(path, **F32)
    steps = record_steps(monkeypatch, llm.engine.scheduler)
    outs = llm.embed(TEXTS, PoolingParams(dimensions=dimensions))
    assert_same_vectors([o.embedding for o in outs], reference_vectors(path, TEXTS, dimensions))
    tok = llm.get_tokenizer()
    assert [o.num_prompt_tokens for o in outs] == [len(tok.encode(t)) for t in TEXTS]
    # Mixed lengths share one step, each input whole; no K/V tensor exists.
    assert len(steps[0]) == len(TEXTS)
    assert all(before == 0 and n == total for step in steps for before, n, total in step)
    assert llm.engine.runner.kv_cache.numel() == 0 and llm.engine.runner.kv_caches == []
    assert_no_leaks(llm.engine)


def test_inputs_run_whole_and_one_over_the_step_budget_is_refused(st_root, monkeypatch):
    path = sentence_transformers_encoder(st_root, "bert", "mean", True)
    llm = LLM(path, max_num_batched_tokens=32, max_num_seqs=4, **F32)
    engine = llm.engine
    assert not engine.config.scheduler.enable_chunked_prefill and not engine.config.cache.enable_prefix_caching
    tok = llm.get_tokenizer()
    short = [t for t in TEXTS if len(tok.encode(t)) <= 32]
    long = next(t for t in TEXTS if len(tok.encode(t)) > 32)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.add_request("long", long, SamplingParams(pooling=PoolingParams()))
    steps = record_steps(monkeypatch, engine.scheduler)
    outs = llm.embed(short * 3)
    assert all(sum(n for _, n, _ in s) <= 32 for s in steps)
    assert all(before == 0 and n == total for step in steps for before, n, total in step)
    assert_same_vectors([o.embedding for o in outs], reference_vectors(path, short * 3))
    assert_no_leaks(engine)


def test_an_input_of_every_position_is_served(st_root):
    path = sentence_transformers_encoder(st_root, "xlm-roberta", "cls", True)
    llm = LLM(path, **F32)
    tok = llm.get_tokenizer()
    text = "tea and cake " * 200
    ids = [*tok.encode(text)[:511], tok.sep_token_id]  # 512 tokens: the whole position table
    out = llm.embed([ids])[0]
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    with torch.no_grad():
        want = model(features)["sentence_embedding"][0]
    assert_same_vectors([out.embedding], want.unsqueeze(0))


def test_xlm_roberta_positions_skip_padding_tokens_inside_an_input(tmp_path):
    """Token-id input may hold the padding id: transformers gives it the padding position and
    numbers the tokens after it as if it were absent."""
    from transformers import XLMRobertaModel

    path = build_tiny_encoder(tmp_path / "xlmr", "xlm-roberta")
    llm = LLM(str(path), **F32)
    pad = llm.get_tokenizer().pad_token_id
    inputs = [[0, 40, 41, pad, 42, 43, 2], [0, 50, 2]]
    outs = llm.embed(inputs, PoolingParams(pooling="mean", normalize=False))
    model = XLMRobertaModel.from_pretrained(str(path)).float().eval()
    for ids, out in zip(inputs, outs, strict=True):
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        assert_same_vectors([out.embedding], hidden.mean(dim=0, keepdim=True))


def test_an_encoder_refuses_generation_and_defaults_to_mean_pooling(tmp_path):
    path = build_tiny_encoder(tmp_path / "bert", "bert")  # no sentence-transformers files
    llm = LLM(str(path), **F32)
    with pytest.raises(ValueError, match="encoder"):
        llm.engine.add_request("gen", "the chef", SamplingParams(max_tokens=4))
    out = llm.embed(TEXTS[:2])
    assert_same_vectors([o.embedding for o in out], reference_vectors(str(path), TEXTS[:2]))
    assert_no_leaks(llm.engine)
