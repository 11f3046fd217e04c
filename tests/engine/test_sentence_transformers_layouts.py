"""sentence-transformers' files in both layouts (6.x module paths and ``pooling_mode``, the
older ``sentence_transformers.models.*`` and ``pooling_mode_*`` flags) read as it reads them,
an encoder saved by sentence-transformers itself embedded as its ``encode`` embeds, and a
module the engine does not serve refused at load, named."""

from __future__ import annotations

import json

import pytest

from conveyor.engine import LLM
from conveyor.engine.pooling.pooling_config import read_pooling_config
from conveyor.testing.tiny_models import build_tiny_encoder
from tests.engine.embedding_helpers import TEXTS, assert_same_vectors, reference_vectors

F32 = {"dtype": "float32", "device": "cpu"}
OLD = {"transformer": "sentence_transformers.models.Transformer", "pooling": "sentence_transformers.models.Pooling"}
OLD["normalize"] = "sentence_transformers.models.Normalize"
NEW = {
    "transformer": "sentence_transformers.base.modules.transformer.Transformer",
    "pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    "normalize": "sentence_transformers.base.modules.normalize.Normalize",
}
OLD_FLAGS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
NEW_MODES = {"last": "lasttoken", "mean": "mean", "cls": "cls"}


def _write(path, layout: dict, pooling: dict, normalize: bool, extra: list[dict] | None = None) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": layout["transformer"]},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": layout["pooling"]},
        *(extra or []),
    ]
    if normalize:
        modules.append({"idx": len(modules), "name": "n", "path": "2_Normalize", "type": layout["normalize"]})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 64, **pooling}))


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_both_layouts_are_read(tmp_path, mode, normalize):
    (tmp_path / "old").mkdir()
    _write(tmp_path / "old", OLD, {flag: m == mode for m, flag in OLD_FLAGS.items()}, normalize)
    (tmp_path / "new").mkdir()
    _write(tmp_path / "new", NEW, {"pooling_mode": NEW_MODES[mode], "include_prompt": True}, normalize)
    for layout in ("old", "new"):
        config = read_pooling_config(tmp_path / layout)
        assert (config.pooling, config.normalize) == (mode, normalize), layout


@pytest.mark.parametrize(
    "pooling,refused",
    [
        ({"pooling_mode": "max"}, "pooling_mode 'max'"),
        ({"pooling_mode": "weightedmean"}, "pooling_mode 'weightedmean'"),
        ({"pooling_mode": ["mean", "cls"]}, "exactly one"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "exactly one"),
        ({"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    ],
)
def test_a_pooling_mode_the_engine_cannot_compute_is_refused(tmp_path, pooling, refused):
    _write(tmp_path, NEW, pooling, True)
    with pytest.raises(ValueError, match=refused):
        read_pooling_config(tmp_path)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return build_tiny_encoder(tmp_path_factory.mktemp("st63") / "bert", "bert")


def test_an_encoder_saved_by_sentence_transformers_embeds_as_its_encode(encoder, tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(encoder))
    modules = [transformer, Pooling(transformer.get_word_embedding_dimension(), "mean"), Normalize()]
    saved = str(tmp_path / "saved")
    SentenceTransformer(modules=modules, device="cpu").save(saved)
    assert "sentence_transformer.modules.pooling.Pooling" in (tmp_path / "saved" / "modules.json").read_text()
    llm = LLM(saved, **F32)
    config = llm.engine.embedding.config
    assert config is not None and (config.pooling, config.normalize) == ("mean", True)
    assert_same_vectors([o.embedding for o in llm.embed(TEXTS)], reference_vectors(saved, TEXTS))


def test_a_module_the_engine_does_not_serve_is_refused_at_load(encoder, tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    transformer = Transformer(str(encoder))
    modules = [transformer, Pooling(64, "cls"), Dense(64, 16), Normalize()]
    saved = str(tmp_path / "dense")
    SentenceTransformer(modules=modules, device="cpu").save(saved)
    with pytest.raises(ValueError, match=r"sentence_transformers\.base\.modules\.dense\.Dense"):
        LLM(saved, **F32)
