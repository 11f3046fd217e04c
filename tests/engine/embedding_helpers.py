"""Builders and checks the embedding tests share: a tiny sentence-transformers checkpoint and
the comparison with sentence-transformers' own ``encode``."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from conveyor.testing.tiny_models import add_sentence_transformers_files, build_tiny_encoder, build_tiny_model

# Mixed lengths: one token, a few, and longer than the chunk budgets the tests set.
TEXTS = [
    "the chef brings hot soup to the table",
    "a",
    "tea and cake " * 12,
    "the waiter asks the guest about the bill and the tip",
    "fresh bread, sweet wine, bitter coffee and cold water for the early guest " * 3,
]


def sentence_transformers_model(root: Path, family: str, pooling: str, normalize: bool) -> str:
    """A tiny random-weight ``family`` checkpoint with sentence-transformers' pooling files."""
    path = root / f"{family}-{pooling}-{'norm' if normalize else 'raw'}"
    if not (path / "modules.json").exists():
        shutil.rmtree(path, ignore_errors=True)
        build_tiny_model(path, family)
        add_sentence_transformers_files(path, pooling, normalize)
    return str(path)


def sentence_transformers_encoder(root: Path, family: str, pooling: str, normalize: bool) -> str:
    """A tiny random-weight encoder (``bert``, ``xlm-roberta``) with sentence-transformers' pooling files."""
    path = root / f"{family}-{pooling}-{'norm' if normalize else 'raw'}"
    if not (path / "modules.json").exists():
        shutil.rmtree(path, ignore_errors=True)
        build_tiny_encoder(path, family)
        add_sentence_transformers_files(path, pooling, normalize)
    return str(path)


def reference_vectors(path: str, texts: list[str], dimensions: int | None = None) -> torch.Tensor:
    """sentence-transformers' ``encode`` of ``texts`` in float32 (truncated to ``dimensions``
    and re-normalised when the model normalises, as OpenAI's ``dimensions`` is)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    normalize = any(type(m).__name__ == "Normalize" for m in model)
    return model.encode(texts, convert_to_tensor=True, truncate_dim=dimensions, normalize_embeddings=normalize).float()


def assert_same_vectors(got: Sequence[list[float] | None], want: torch.Tensor) -> None:
    """Cosine at least 0.99999 and the same norm, vector by vector."""
    assert len(got) == len(want)
    for i, (vec, ref) in enumerate(zip(got, want, strict=True)):
        assert vec is not None, f"input {i}: no vector"
        v = torch.tensor(vec, dtype=torch.float32)
        assert v.shape == ref.shape, f"input {i}: {tuple(v.shape)} != {tuple(ref.shape)}"
        cos = torch.nn.functional.cosine_similarity(v, ref, dim=0).item()
        assert cos >= 0.99999, f"input {i}: cosine {cos}"
        assert abs(v.norm().item() - ref.norm().item()) <= 1e-4 * ref.norm().item(), f"input {i}: norms differ"
