"""Scoring a text pair (``LLM.score``; the worker's ``/v1/score`` and ``/v1/rerank``): what the
checkpoint's scoring head is, how a pair becomes one prompt, and the score from the pooled row.

Two kinds of checkpoint score, each as its reference computes it:

- a cross-encoder, ``BertForSequenceClassification`` or ``XLMRobertaForSequenceClassification``
  with one label: the pair tokenised as the tokenizer pairs texts (``[CLS] a [SEP] b [SEP]``,
  its token types), the classification head on the first token's hidden state, then the
  activation sentence-transformers' ``CrossEncoder`` applies, found where it looks
  (``config_sentence_transformers.json``'s ``activation_fn``, ``config.json``'s
  ``sentence_transformers.activation_fn``, then its older ``sbert_ce_default_activation_function``:
  ``Sigmoid`` or ``Identity``; sigmoid when none is named). A ``modules.json`` (what
  sentence-transformers 6 saves) must list the Transformer alone: other modules are refused;
- Qwen3-Reranker, a ``*ForCausalLM`` whose ``config.json`` carries vLLM's reranker keys
  ``"classifier_from_token": [false_token, true_token]`` and ``"is_original_qwen3_reranker":
  true``: the pair in Qwen's published prompt (system prefix, ``<Instruct>/<Query>/<Document>``,
  the empty thinking block), each piece tokenised without special tokens as the model card does,
  and ``sigmoid(logit[true] - logit[false])`` of the last token (the card's softmax over the
  two, and sentence-transformers' ``LogitScore`` with its sigmoid).

Any other checkpoint has no scoring head: its score requests are refused with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conveyor.engine.models.bert import encode_token_types
from conveyor.engine.models.model_config import ModelSpec

# sentence-transformers' activations a cross-encoder's config may name (``activation_fn``).
_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": True,
    "torch.nn.Sigmoid": True,
    "torch.nn.modules.linear.Identity": False,
    "torch.nn.Identity": False,
}

# Qwen3-Reranker's published prompt (its model card), around the formatted pair.
QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def qwen3_reranker_text(query: str, document: str, instruction: str = QWEN3_RERANKER_INSTRUCTION) -> str:
    """The body of Qwen3-Reranker's prompt for one pair, between its prefix and suffix."""
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


Scorer = Callable[[Any, list[int]], float]


@dataclass(frozen=True)
class ScoreHead:
    """A checkpoint's scoring head: which row it reads (``cls``: the first; ``last``), how a
    pair becomes token ids, and the score of the pooled row (``scorer``)."""

    pooling: str
    encode: Callable[[Any, str, str], list[int]]
    scorer: Scorer


def _read_config(model_dir: Path, name: str = "config.json") -> dict:
    path = model_dir / name
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def score_head(model_dir: Path, spec: ModelSpec, model: Any, tokenizer: Any) -> ScoreHead | str:
    """The checkpoint's scoring head, or why it has none (the reason a score request gets)."""
    config = _read_config(model_dir)
    if spec.encoder:
        return _cross_encoder(model_dir, config, spec, model)
    return _yes_no_reranker(config, spec, tokenizer)


def _activation(model_dir: Path, config: dict) -> str | None:
    """The activation a checkpoint names, where sentence-transformers looks for it, in its order."""
    names = [_read_config(model_dir, "config_sentence_transformers.json").get("activation_fn")]
    st = config.get("sentence_transformers")
    names += [
        st.get("activation_fn") if isinstance(st, dict) else None,
        config.get("sbert_ce_default_activation_function"),
    ]
    return next((n for n in names if n is not None), None)


def _extra_modules(model_dir: Path) -> str | None:
    """Why a ``modules.json`` cannot be scored as the classifier alone (None: it can)."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{path} is not readable JSON: {exc}"
    kinds = (
        [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
        if isinstance(modules, list)
        else []
    )
    if kinds != ["Transformer"]:
        return f"{path} lists {kinds}; the engine scores with the Transformer's classifier alone"
    return None


def _cross_encoder(model_dir: Path, config: dict, spec: ModelSpec, model: Any) -> ScoreHead | str:
    head = getattr(model, "score_head", None)
    if not spec.num_labels or head is None:
        return (
            f"{spec.architecture} has no scoring head: it embeds; a cross-encoder is a "
            "BertForSequenceClassification or XLMRobertaForSequenceClassification checkpoint"
        )
    if spec.num_labels != 1:
        return f"this cross-encoder's classifier has {spec.num_labels} labels; a score comes from one"
    extra = _extra_modules(model_dir)
    if extra is not None:
        return extra
    name = _activation(model_dir, config)
    if name is not None and name not in _ACTIVATIONS:
        return f"activation_fn {name!r} is not served; the engine applies Sigmoid or Identity"
    sigmoid = True if name is None else _ACTIVATIONS[name]
    vocab, types = spec.vocab_size, spec.type_vocab_size

    def encode(tokenizer: Any, text_1: str, text_2: str) -> list[int]:
        enc = tokenizer(text_1, text_2)
        ids = list(enc["input_ids"])
        kinds = list(enc.get("token_type_ids") or [0] * len(ids))
        if max(kinds) >= max(types, 1):
            raise ValueError(f"the tokenizer gives token types the model's {types}-row table does not hold")
        return encode_token_types(ids, kinds, vocab)

    def scorer(rows: Any, wanted: list[int]) -> float:
        logit = head(rows.hidden(wanted[:1]))[0, 0].float()
        return float(torch.sigmoid(logit) if sigmoid else logit)

    return ScoreHead("cls", encode, scorer)


def _yes_no_reranker(config: dict, spec: ModelSpec, tokenizer: Any) -> ScoreHead | str:
    tokens = config.get("classifier_from_token")
    if tokens is None:
        return (
            f"{spec.architecture} has no scoring head: a decoder scores as Qwen3-Reranker only, when its "
            'config.json sets "classifier_from_token": ["no", "yes"] and "is_original_qwen3_reranker": true'
        )
    if not config.get("is_original_qwen3_reranker"):
        return "classifier_from_token is served with is_original_qwen3_reranker true (Qwen3-Reranker's prompt) only"
    if spec.model_type != "qwen3":
        return f"is_original_qwen3_reranker is for a Qwen3 checkpoint; this is {spec.model_type}"
    if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)):
        return f"classifier_from_token must be two tokens [false, true], got {tokens!r}"
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if any(i is None or i == tokenizer.unk_token_id or not 0 <= i < spec.vocab_size for i in ids):
        return f"classifier_from_token {tokens!r}: the tokenizer does not hold both as single tokens"
    false_id, true_id = ids

    def encode(tok: Any, text_1: str, text_2: str) -> list[int]:
        pieces = (QWEN3_RERANKER_PREFIX, qwen3_reranker_text(text_1, text_2), QWEN3_RERANKER_SUFFIX)
        return [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)]

    def scorer(rows: Any, wanted: list[int]) -> float:
        logits = rows(wanted[-1:])[0].float()
        return float(torch.sigmoid(logits[true_id] - logits[false_id]))

    return ScoreHead("last", encode, scorer)
