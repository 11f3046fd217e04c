"""What the docs say is not served, or not yet supported, checked against the code: a
"Not served" sentence names no batch endpoint the API serves (``request_body.ENDPOINTS``), a
"Not yet" or "Not served" sentence no architecture the engine runs (``SUPPORTED_ARCHITECTURES``),
and the HTTP API page lists exactly the endpoints served."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from conveyor.engine.models.registry import SUPPORTED_ARCHITECTURES
from conveyor.worker.batchio.request_body import ENDPOINTS
from tests.test_docs import REPO

PAGES = [*sorted((REPO / "docs").rglob("*.md")), REPO / "ARCHITECTURE.md", REPO / "README.md"]
# From "Not served" or "Not yet" to the end of its sentence (Qwen3.5's dot is not one).
CLAIM = re.compile(r"\bNot (?:served|yet)\b.*?(?:\.(?=\s|$)|$)", re.DOTALL)
ENDPOINT = re.compile(r"`(/v1/[a-z/_]+)`")


def _flowed(text: str) -> str:
    """The page with each paragraph on one line (a sentence wrapped over lines is whole again)."""
    return "\n\n".join(" ".join(line.strip() for line in block.splitlines()) for block in re.split(r"\n\s*\n", text))


def claims(text: str) -> Iterator[str]:
    for paragraph in _flowed(text).split("\n\n"):
        yield from CLAIM.findall(paragraph)


def named_architectures(sentence: str) -> set[str]:
    """The architectures (or their ``model_type``, case aside, as in "BERT") a sentence names."""
    found = set()
    for architecture, model_type in SUPPORTED_ARCHITECTURES.items():
        for name in (architecture, model_type):
            # (a whole word: not Qwen3 in "Qwen3.5", nor Llama in "llama.cpp")
            if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-]|\.\w)", sentence, re.IGNORECASE):
                found.add(architecture)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_what_the_docs_call_unserved_is_unserved(page) -> None:
    for sentence in claims(page.read_text(encoding="utf-8")):
        served = sorted(set(ENDPOINT.findall(sentence)) & set(ENDPOINTS))
        assert not served, f"{page.name} calls served endpoints {served} unserved: {sentence!r}"
        runs = sorted(named_architectures(sentence))
        assert not runs, f"{page.name} calls architectures the engine runs {runs} unsupported: {sentence!r}"


def test_the_http_api_page_lists_the_endpoints_served() -> None:
    text = (REPO / "docs/user-guide/http-api.md").read_text(encoding="utf-8")
    [served] = re.findall(r"^- Batch endpoints:(.*?)Not served", text, re.DOTALL | re.MULTILINE)
    listed = ENDPOINT.findall(served)
    assert sorted(listed) == sorted(ENDPOINTS)


def test_the_check_catches_the_claims_it_was_written_for() -> None:
    # The sentences that were wrong, as they were.
    http_api = (
        "the same key with a different\nfile is a 409. Not served: `output_expires_after` (a 400), other endpoints\n"
        "(`/v1/embeddings`, `/v1/responses`, ...: a 400).\n"
    )
    [sentence] = claims(http_api)
    assert set(ENDPOINT.findall(sentence)) & set(ENDPOINTS) == {"/v1/embeddings", "/v1/responses"}
    embeddings = (
        "Not yet: encoder-only models (BERT, XLM-RoBERTa) and embeddings under tensor parallelism\n"
        "(refused with the reason).\n"
    )
    [sentence] = claims(embeddings)
    assert named_architectures(sentence) == {
        "BertModel",
        "XLMRobertaModel",
        "BertForSequenceClassification",  # (the cross-encoders share their model_type)
        "XLMRobertaForSequenceClassification",
    }
    assert named_architectures("Not yet: Qwen3.5's GGUF files from llama.cpp's converter.") == set()
    assert named_architectures("Not yet: Qwen3 and Llama on TPUs.") == {"Qwen3ForCausalLM", "LlamaForCausalLM"}
