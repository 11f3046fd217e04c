"""Embedding requests (``conveyor.engine.pooling.pooler``) against sentence-transformers' ``encode`` on tiny
random-weight models: pooling modes, normalisation, ``dimensions``, chunked prefill, prefix
cache hits, sharing steps with generation, and KV freed as soon as the vector is out."""

from __future__ import annotations

import json

import pytest

from conveyor.engine import LLM, PoolingParams, SamplingParams
from conveyor.engine.pooling.pooling_config import PoolingConfig, read_pooling_config
from tests.engine.embedding_helpers import TEXTS, assert_same_vectors, reference_vectors, sentence_transformers_model
from tests.engine.helpers import assert_no_leaks, record_steps

F32 = {"dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def st_root(tmp_path_factory):
    return tmp_path_factory.mktemp("st-models")


@pytest.mark.parametrize(
    "pooling,normalize,dimensions",
    [("last", True, None), ("last", False, 24), ("mean", True, 16), ("mean", False, None), ("cls", True, None)],
)
def test_decoder_vectors_equal_sentence_transformers(st_root, pooling, normalize, dimensions):
    path = sentence_transformers_model(st_root, "qwen3", pooling, normalize)
    llm = LLM(path, **F32)
    outs = llm.embed(TEXTS, PoolingParams(dimensions=dimensions))
    assert_same_vectors([o.embedding for o in outs], reference_vectors(path, TEXTS, dimensions))
    tok = llm.get_tokenizer()
    assert [o.num_prompt_tokens for o in outs] == [len(tok.encode(t)) for t in TEXTS]
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_prefill_pools_across_chunks(st_root, monkeypatch, pooling):
    path = sentence_transformers_model(st_root, "qwen3", pooling, True)
    llm = LLM(path, max_num_batched_tokens=16, max_num_seqs=2, **F32)
    steps = record_steps(monkeypatch, llm.engine.scheduler)
    outs = llm.embed(TEXTS)
    assert max(o.num_prompt_tokens for o in outs) > 16
    assert all(sum(n for _, n, _ in s) <= 16 for s in steps)
    assert_same_vectors([o.embedding for o in outs], reference_vectors(path, TEXTS))
    assert_no_leaks(llm.engine)


def test_last_token_pooling_reuses_the_prefix_cache_and_mean_pooling_does_not(st_root):
    instruction = "Instruct: count the tokens of the batch queue in the cache\nQuery: " * 2
    texts = [instruction + t for t in TEXTS]
    for pooling, expect_hits in (("last", True), ("mean", False)):
        path = sentence_transformers_model(st_root, "qwen3", pooling, True)
        llm = LLM(path, block_size=4, **F32)
        first = llm.embed(texts[:1])  # cached before the others arrive
        rest = llm.embed(texts[1:])
        stats = llm.engine.stats()
        assert (stats.prefix_cache_hits > 0) is expect_hits, pooling
        assert_same_vectors([o.embedding for o in first + rest], reference_vectors(path, texts))
        assert_no_leaks(llm.engine)


def test_embedding_and_generation_share_steps_and_keep_their_outputs(st_root, monkeypatch):
    path = sentence_transformers_model(st_root, "qwen3", "last", True)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stream=False)
    alone = LLM(path, **F32).generate(["the guest waits for the waiter"], greedy)[0].token_ids
    llm = LLM(path, max_num_batched_tokens=24, **F32)
    engine = llm.engine
    steps = record_steps(monkeypatch, engine.scheduler)
    engine.add_request("gen", "the guest waits for the waiter", greedy)
    engine.step()  # its prefill: it decodes from now on
    for i, text in enumerate(TEXTS):
        engine.add_request(f"emb-{i}", text, SamplingParams(pooling=PoolingParams()))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert any(any(n == 1 for _, n, _ in s) and any(n > 1 for _, n, _ in s) for s in steps[1:])
    assert outs["gen"].token_ids == alone and outs["gen"].embedding is None
    assert_same_vectors([outs[f"emb-{i}"].embedding for i in range(len(TEXTS))], reference_vectors(path, TEXTS))
    assert_no_leaks(engine)


def test_an_embedding_frees_its_kv_in_the_step_its_prompt_ends(st_root):
    path = sentence_transformers_model(st_root, "qwen3", "mean", False)
    engine = LLM(path, **F32).engine
    engine.add_request("e", TEXTS[2], SamplingParams(pooling=PoolingParams()))
    (out,) = engine.step()
    assert out.finished and out.embedding is not None
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert_no_leaks(engine)


def test_bad_embedding_requests_are_refused_with_the_reason(st_root, tmp_path):
    path = sentence_transformers_model(st_root, "qwen3", "last", True)
    llm = LLM(path, **F32)
    with pytest.raises(ValueError, match="dimensions must be at most the model's embedding size 64"):
        llm.engine.add_request("a", "tea", SamplingParams(pooling=PoolingParams(dimensions=65)))
    with pytest.raises(ValueError, match="n=1"):
        llm.engine.add_request("b", "tea", SamplingParams(n=2, pooling=PoolingParams()))
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams(pooling="max")
    (bad,) = llm.embed([[10**6]])
    assert bad.embedding == [] and "not in the vocabulary" in (bad.error or "")


def test_a_model_whose_pooling_the_engine_cannot_compute_generates_but_refuses_to_embed(st_root, tmp_path):
    path = sentence_transformers_model(st_root, "qwen3", "last", True)
    pooling_file = tmp_path / "1_Pooling" / "config.json"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "modules.json"):
        (tmp_path / name).write_bytes((st_root / path / name).read_bytes())
    pooling_file.parent.mkdir()
    pooling_file.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    llm = LLM(str(tmp_path), **F32)
    assert llm.generate(["tea"], SamplingParams(max_tokens=2))[0].finish_reason in ("stop", "length")
    (out,) = llm.embed(["tea"])
    assert out.embedding == [] and out.error is not None
    assert "cannot embed" in out.error and "pooling_mode_max_tokens" in out.error


def test_pooling_config_is_read_as_sentence_transformers_reads_it(tmp_path):
    assert read_pooling_config(tmp_path) == PoolingConfig()
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    config = read_pooling_config(tmp_path)
    assert (config.pooling, config.normalize) == ("cls", False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert read_pooling_config(tmp_path).normalize is True
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True})
    )
    with pytest.raises(ValueError, match="exactly one of"):
        read_pooling_config(tmp_path)
