"""``LLM.score`` (``conveyor.engine.pooling.scoring``) against its references in float32: BERT and
XLM-R cross-encoders against sentence-transformers' ``CrossEncoder.predict``, the Qwen3
reranker against transformers' causal LM's yes/no logits over Qwen's published prompt; a
model without a scoring head is refused per request with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor.engine import LLM, PoolingParams, SamplingParams
from conveyor.testing.tiny_models import build_tiny_encoder
from tests.engine.helpers import assert_no_leaks
from tests.engine.score_checkpoints import build_cross_encoder, build_qwen3_reranker, qwen3_reranker_reference

F32 = {"dtype": "float32", "device": "cpu"}
QUERIES = ["the chef brings hot soup", "a", "the waiter asks the guest about the bill and the tip"]
DOCUMENTS = ["soup is hot", "tea and cake " * 12, "the guest pays the bill [SEP] and leaves"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scoring")


def _cross_encoder_reference(path: str, pairs: list[list[str]]) -> torch.Tensor:
    from sentence_transformers import CrossEncoder

    return torch.tensor(CrossEncoder(path, device="cpu").predict(pairs), dtype=torch.float32)


@pytest.mark.parametrize(
    "family,activation",
    [("bert", None), ("xlm-roberta", None), ("bert", "torch.nn.modules.linear.Identity")],
)
def test_cross_encoder_scores_equal_sentence_transformers(root, family, activation):
    path = build_cross_encoder(root / f"{family}-{activation}", family, activation=activation)
    llm = LLM(path, **F32)
    outs = llm.score(QUERIES, DOCUMENTS)
    want = _cross_encoder_reference(path, [list(p) for p in zip(QUERIES, DOCUMENTS, strict=True)])
    assert [o.error for o in outs] == [None] * len(QUERIES)
    got = torch.tensor([o.score for o in outs])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    tok = llm.get_tokenizer()
    assert [o.num_prompt_tokens for o in outs] == [
        len(tok(a, b)["input_ids"]) for a, b in zip(QUERIES, DOCUMENTS, strict=True)
    ]
    assert_no_leaks(llm.engine)


def test_one_query_against_many_documents(root):
    path = build_cross_encoder(root / "bert-1n", "bert")
    llm = LLM(path, **F32)
    outs = llm.score(QUERIES[0], DOCUMENTS)
    want = _cross_encoder_reference(path, [[QUERIES[0], d] for d in DOCUMENTS])
    torch.testing.assert_close(torch.tensor([o.score for o in outs]), want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(QUERIES[:2], DOCUMENTS)


def test_qwen3_reranker_scores_equal_transformers_yes_no(root):
    path, tokens = build_qwen3_reranker(root / "qwen3-reranker")
    llm = LLM(path, **F32)
    outs = llm.score(QUERIES[0], DOCUMENTS)
    hits = llm.engine.stats().prefix_cache_hits
    outs += llm.score(QUERIES, DOCUMENTS)
    # The second call's prompts open with the first's: Qwen's prompt head comes from the prefix cache.
    assert llm.engine.stats().prefix_cache_hits > hits
    pairs = [(QUERIES[0], d) for d in DOCUMENTS] + list(zip(QUERIES, DOCUMENTS, strict=True))
    assert [o.error for o in outs] == [None] * len(pairs)
    want = qwen3_reranker_reference(path, tokens, pairs)
    torch.testing.assert_close(torch.tensor([o.score for o in outs]), want, atol=1e-5, rtol=0)
    assert_no_leaks(llm.engine)


def test_models_without_a_scoring_head_are_refused_per_request(root):
    plain_decoder, _ = build_qwen3_reranker(root / "qwen3-plain", reranker_keys=False)
    llm = LLM(plain_decoder, **F32)
    outs = llm.score("a", ["b", "c"])
    assert [o.score for o in outs] == [None, None]
    assert all("no scoring head" in (o.error or "") and "classifier_from_token" in (o.error or "") for o in outs)
    assert llm.generate(["the chef"], SamplingParams(max_tokens=2))[0].error is None  # it still generates
    del llm

    encoder = build_tiny_encoder(root / "plain-bert", "bert")
    llm = LLM(str(encoder), **F32)
    out = llm.score("a", "b")[0]
    assert out.score is None and "BertModel has no scoring head" in (out.error or "")
    assert llm.embed(["a"])[0].error is None  # it still embeds


def test_a_cross_encoder_with_two_labels_is_refused(root):
    path = build_cross_encoder(root / "bert-2-labels", "bert", num_labels=2)
    out = LLM(path, **F32).score("a", "b")[0]
    assert out.score is None and "2 labels" in (out.error or "")


def test_score_requests_are_checked(root):
    path = build_cross_encoder(root / "bert-checks", "bert")
    engine = LLM(path, **F32).engine
    params = SamplingParams(pooling=PoolingParams(task="score"))
    with pytest.raises(ValueError, match="text_pair"):
        engine.add_request("plain", "just one text", params)
    with pytest.raises(ValueError, match="text_2 is empty"):
        engine.add_request("empty", {"text_pair": ["a", ""]}, params)
    with pytest.raises(ValueError, match="takes no pooling"):
        PoolingParams(task="score", pooling="cls")
    with pytest.raises(ValueError, match=r"prompt is at least \d+ tokens"):
        engine.add_request("long", {"text_pair": ["tea and cake " * 400, "b"]}, params)


def test_a_cross_encoder_saved_by_sentence_transformers_scores_with_its_activation(root):
    from sentence_transformers import CrossEncoder

    saved = root / "st-saved"
    path = build_cross_encoder(root / "bert-to-save", "bert")
    model = CrossEncoder(path, device="cpu", activation_fn=torch.nn.Identity())
    model.save(str(saved))  # modules.json, and the activation in config_sentence_transformers.json
    outs = LLM(str(saved), **F32).score(QUERIES, DOCUMENTS)
    want = _cross_encoder_reference(str(saved), [list(p) for p in zip(QUERIES, DOCUMENTS, strict=True)])
    assert ((want < 0) | (want > 1)).any()  # raw logits: the sigmoid was not applied
    torch.testing.assert_close(torch.tensor([o.score for o in outs]), want, atol=1e-5, rtol=0)


def test_a_cross_encoder_with_modules_after_the_classifier_is_refused_at_load(root):
    path = Path(build_cross_encoder(root / "bert-dense", "bert"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.base.modules.dense.Dense"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    # It can neither embed nor score: refused at load, with both reasons.
    with pytest.raises(ValueError, match=r"cannot embed: .*Dense.*nor score: .*\['Transformer', 'Dense'\]"):
        LLM(str(path), **F32)


def test_qwen3_reranker_keys_on_another_family_are_refused(root):
    from conveyor.testing.tiny_models import build_tiny_model

    path = build_tiny_model(root / "llama-with-reranker-keys", "llama")
    config = json.loads((path / "config.json").read_text())
    config.update(classifier_from_token=["Ġtwo", "Ġone"], is_original_qwen3_reranker=True)
    (path / "config.json").write_text(json.dumps(config))
    out = LLM(str(path), **F32).score("a", "b")[0]
    assert out.score is None and "is for a Qwen3 checkpoint; this is llama" in (out.error or "")
