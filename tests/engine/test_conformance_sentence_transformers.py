"""Each embedder's published sentence-transformers files (``tests/data/checkpoints/<family>/<release>/``,
sources in ``SOURCES.md``): the engine reads their pooling and normalisation as
sentence-transformers itself reads them, and a random-weight model shrunk from the release's
published config.json (``shrunk_checkpoint``; its family's where the release's own was not
found), carrying those files unchanged but for the
Pooling module's size field, embeds as ``SentenceTransformer(path).encode`` does in float32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conveyor.engine.pooling.pooling_config import read_pooling_config
from tests.engine.embedding_helpers import TEXTS, assert_same_vectors, reference_vectors
from tests.engine.shrunk_checkpoint import build_shrunk_checkpoint

CHECKPOINTS = Path(__file__).resolve().parents[1] / "data" / "checkpoints"
EMBEDDERS = ["bert/all-MiniLM-L6-v2", "xlm_roberta/multilingual-e5-base"]
# The sentence-transformers files, as published (the Pooling module's folder is named in modules.json).
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def shrunk_embedder(root: Path, release: str) -> Path:
    """The release's model shrunk in size, its sentence-transformers files copied beside it; the
    Pooling config's ``word_embedding_dimension`` (a size field) set to the shrunk width."""
    published = CHECKPOINTS / release
    # (a release whose own config.json was not found is built from its family's: SOURCES.md)
    model = published if (published / "config.json").is_file() else published.parent
    path = build_shrunk_checkpoint(root / release.replace("/", "-"), model)
    for name in ST_FILES:
        if (published / name).is_file():
            shutil.copyfile(published / name, path / name)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    for module in json.loads((published / "modules.json").read_text()):
        folder = published / module["path"]
        if module["path"] and folder.is_dir():
            shutil.copytree(folder, path / module["path"], dirs_exist_ok=True)
            config = path / module["path"] / "config.json"
            settings = json.loads(config.read_text())
            for key in ("word_embedding_dimension", "embedding_dimension"):
                if key in settings:
                    settings[key] = hidden
            config.write_text(json.dumps(settings, indent=2))
    return path


@pytest.mark.parametrize("release", EMBEDDERS)
def test_the_engine_reads_the_published_files_as_sentence_transformers_does(release, tmp_path):
    from sentence_transformers import SentenceTransformer

    ours = read_pooling_config(CHECKPOINTS / release)
    theirs = SentenceTransformer(str(shrunk_embedder(tmp_path, release)), device="cpu")
    pooling = next(m for m in theirs if type(m).__name__ == "Pooling")
    modes = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
    assert ours.pooling == modes[str(pooling.pooling_mode)]
    assert ours.normalize == any(type(m).__name__ == "Normalize" for m in theirs)
    assert (CHECKPOINTS / "SOURCES.md").read_text().count(f"`{release}/") >= 1, "no source named"


@pytest.mark.parametrize("release", EMBEDDERS)
def test_a_model_shrunk_from_the_published_files_embeds_as_sentence_transformers(release, tmp_path, make_llm):
    path = str(shrunk_embedder(tmp_path, release))
    llm = make_llm(path)
    assert_same_vectors([o.embedding for o in llm.embed(TEXTS)], reference_vectors(path, TEXTS))
