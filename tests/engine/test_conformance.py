"""Each family's published config files (``tests/data/checkpoints/<family>/``, sources in its
``SOURCES.md``) as the engine meets them: the model description is built from the file
unchanged, and a random-weight model shrunk from it in size only (``shrunk_checkpoint``)
generates transformers' own greedy tokens in float32 (an encoder: its hidden states' mean)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor.engine import PoolingParams
from conveyor.engine.models.model_config import ModelSpec
from tests.engine.embedding_helpers import assert_same_vectors
from tests.engine.reference import Greedy, assert_greedy_match, greedy, oracle_model
from tests.engine.shrunk_checkpoint import build_shrunk_checkpoint

CHECKPOINTS = Path(__file__).resolve().parents[1] / "data" / "checkpoints"
FAMILIES = sorted(p.name for p in CHECKPOINTS.iterdir() if (p / "config.json").is_file())
ENCODERS = ("bert", "xlm_roberta")
PROMPTS = ["The chef will bring warm bread and", "Tea"]
MAX_TOKENS = 6


def _text_config(cfg: dict) -> dict:
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_description_is_read_from_the_published_file(family):
    spec = ModelSpec.from_pretrained(CHECKPOINTS / family)
    published = _text_config(json.loads((CHECKPOINTS / family / "config.json").read_text()))
    for key, value in (("num_hidden_layers", spec.num_layers), ("hidden_size", spec.hidden_size)):
        if key in published:
            assert published[key] == value, key
    assert (CHECKPOINTS / "SOURCES.md").read_text().count(f"`{family}/") >= 1, f"{family} has no source named"


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ENCODERS])
def test_a_model_shrunk_from_the_published_config_matches_transformers(family, tmp_path, make_llm):
    path = str(build_shrunk_checkpoint(tmp_path / family, CHECKPOINTS / family))
    llm = make_llm(path, max_model_len=256)
    outs = llm.generate(PROMPTS, greedy([MAX_TOKENS] * len(PROMPTS)))
    model = oracle_model(path)
    eos = sorted(llm.engine.eos_token_ids)  # (the engine stops on the tokenizer's EOS as well)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = ref.sequences[0, ids.shape[1] :].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in ref.scores]
        assert_greedy_match(out.token_ids, Greedy(tokens, margins, []), label=f"{family} {prompt!r}")


@pytest.mark.parametrize("family", ENCODERS)
def test_an_encoder_shrunk_from_the_published_config_matches_transformers(family, tmp_path, make_llm):
    from transformers import AutoModel

    path = str(build_shrunk_checkpoint(tmp_path / family, CHECKPOINTS / family))
    llm = make_llm(path)
    outs = llm.embed(PROMPTS, PoolingParams(pooling="mean", normalize=False))
    model = AutoModel.from_pretrained(path, attn_implementation="eager").float().eval()
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            hidden = model(torch.tensor([tokenizer.encode(prompt)])).last_hidden_state[0]
        assert_same_vectors([out.embedding], hidden.mean(dim=0, keepdim=True))
