"""Tiny random-weight scoring checkpoints from the published configs (shrunk in size only):
BERT and XLM-RoBERTa cross-encoders (``*ForSequenceClassification``, one label) and a
Qwen3 reranker (a ``Qwen3ForCausalLM`` with vLLM's reranker keys in its config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.engine.shrunk_checkpoint import build_shrunk_checkpoint, shrink_config

PUBLISHED = Path(__file__).resolve().parents[1] / "data" / "checkpoints"
_FOLDERS = {"bert": "bert", "xlm-roberta": "xlm_roberta"}
# The pair templates the released tokenizers use: BERT's second text is token type 1,
# XLM-R's pair is ``<s> a </s></s> b </s>``, all type 0.
_PAIR_TEMPLATES = {
    "bert": "[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
    "xlm-roberta": "<s> $A </s> </s> $B </s>",
}


def build_cross_encoder(path: Path, family: str, *, activation: str | None = None, num_labels: int = 1) -> str:
    """A ``BertForSequenceClassification`` / ``XLMRobertaForSequenceClassification`` with the
    published config shrunk and the released tokenizers' pair template."""
    import transformers
    from tokenizers import processors

    from conveyor.testing.tiny_models import ENCODER_FAMILIES, _randomize, build_tiny_encoder_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_encoder_tokenizer(path, family)
    info = ENCODER_FAMILIES[family]
    cls, sep = info["cls"], info["sep"]
    backend = tokenizer.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=_PAIR_TEMPLATES[family],
        special_tokens=[(cls, backend.token_to_id(cls)), (sep, backend.token_to_id(sep))],
    )
    tokenizer.save_pretrained(str(path))
    published = json.loads((PUBLISHED / _FOLDERS[family] / "config.json").read_text())
    small = shrink_config(published, len(tokenizer))
    arch = "BertForSequenceClassification" if family == "bert" else "XLMRobertaForSequenceClassification"
    small["architectures"] = [arch]
    small["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    small["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    if activation is not None:
        small["sentence_transformers"] = {"activation_fn": activation}
    config = transformers.AutoConfig.for_model(family, **{k: v for k, v in small.items() if k != "model_type"})
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).float()
    _randomize(model, 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "config.json").write_text(json.dumps(small, indent=2) + "\n")
    return str(path)


def build_qwen3_reranker(path: Path, *, reranker_keys: bool = True) -> tuple[str, list[str]]:
    """A tiny Qwen3 from the published config, with ``classifier_from_token`` naming two tokens
    of its vocabulary (the tiny trained vocabulary holds no "yes"/"no"; which two does not
    change what is computed) and ``is_original_qwen3_reranker``; returns the path and the tokens."""
    build_shrunk_checkpoint(path, PUBLISHED / "qwen3", init_std=0.05)
    tokens = ["Ġtwo", "Ġone"]  # [false, true]
    if reranker_keys:
        config = json.loads((path / "config.json").read_text())
        config["classifier_from_token"] = tokens
        config["is_original_qwen3_reranker"] = True
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(path), tokens


def qwen3_reranker_reference(path: str, tokens: list[str], pairs: list[tuple[str, str]]) -> torch.Tensor:
    """Qwen3-Reranker's model card, one pair at a time, in float32: transformers' causal LM
    over the published prompt, the softmax over the [false, true] tokens' last logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.engine.pooling.scoring import QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX, qwen3_reranker_text

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    false_id, true_id = (tok.convert_tokens_to_ids(t) for t in tokens)
    prefix = tok.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
    scores = []
    for query, doc in pairs:
        ids = prefix + tok(qwen3_reranker_text(query, doc), add_special_tokens=False)["input_ids"] + suffix
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.log_softmax(torch.stack([last[false_id], last[true_id]]), dim=0)[1].exp())
    return torch.stack(scores)
