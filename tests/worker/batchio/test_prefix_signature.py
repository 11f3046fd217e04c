"""A request's prefix signature: canonical text in prompt order, digests at several depths
under the cache salt and the model."""

from __future__ import annotations

from conveyor.worker.batchio.prefix_signature import (
    DEPTHS,
    canonical_prompt,
    grouping_key,
    prefix_signature,
    shared_bytes,
    shared_levels,
    signature_of_text,
)
from conveyor.worker.batchio.records import ParsedRequest
from conveyor.worker.batchio.tools import ToolRequest

KEY = grouping_key("owner:k1", "llama")


def _chat(*messages: tuple[str, str], tools: ToolRequest | None = None) -> ParsedRequest:
    return ParsedRequest(
        line=1, custom_id="a", endpoint="/v1/chat/completions", sampling={},
        messages=[{"role": r, "content": c} for r, c in messages], tools=tools,
    )  # fmt: skip


def test_two_questions_on_one_document_share_the_depths_the_document_covers() -> None:
    doc = "d" * 3000
    a = prefix_signature(_chat(("system", "Be brief."), ("user", doc + " first question?")), KEY)
    b = prefix_signature(_chat(("system", "Be brief."), ("user", doc + " second one?")), KEY)
    levels = shared_levels(a.digests, b.digests)
    # 64 B to 2 KiB lie inside the shared document; 4 KiB is past both texts' ends.
    assert levels == 6
    assert shared_bytes(levels, a.length, b.length) == 2048
    other_doc = prefix_signature(_chat(("system", "Be brief."), ("user", "e" * 3000 + " first question?")), KEY)
    assert shared_levels(a.digests, other_doc.digests) == 0  # the system prompt is under 64 bytes


def test_the_same_prompt_under_another_owner_or_model_shares_nothing() -> None:
    text = b"x" * 5000
    same = signature_of_text(text, KEY)
    assert shared_levels(same.digests, signature_of_text(text, KEY).digests) == len(DEPTHS)
    assert shared_levels(same.digests, signature_of_text(text, grouping_key("owner:k2", "llama")).digests) == 0
    assert shared_levels(same.digests, signature_of_text(text, grouping_key("owner:k1", "qwen")).digests) == 0


def test_canonical_text_follows_prompt_order_roles_and_tools() -> None:
    a = canonical_prompt(_chat(("system", "S"), ("user", "U")))
    assert a.index(b"S") < a.index(b"U")
    assert canonical_prompt(_chat(("user", "S"), ("user", "U"))) != a  # the role is part of the text
    tools = ToolRequest([{"type": "function", "function": {"name": "f", "parameters": {}}}], "auto")
    with_tools = canonical_prompt(_chat(("system", "S"), ("user", "U"), tools=tools))
    assert with_tools.index(b'"name": "f"') < with_tools.index(b"S")  # templates put tools in front
    prompt = ParsedRequest(line=1, custom_id="p", endpoint="/v1/completions", sampling={}, prompt="hello")
    ids = ParsedRequest(line=1, custom_id="p", endpoint="/v1/completions", sampling={}, prompt=[1, 22, 3])
    longer = ParsedRequest(line=1, custom_id="p", endpoint="/v1/completions", sampling={}, prompt=[1, 22, 3, 4])
    assert canonical_prompt(prompt).endswith(b"hello")
    assert canonical_prompt(longer).startswith(canonical_prompt(ids))  # token prefixes stay text prefixes


def _pairs(query: str, *documents: str) -> ParsedRequest:
    return ParsedRequest(
        line=1, custom_id="r", endpoint="/v1/rerank", sampling={}, pairs=[[query, d] for d in documents]
    )


def test_score_lines_that_share_a_query_share_the_depths_it_covers() -> None:
    query = "q" * 1000
    a = prefix_signature(_pairs(query, "first document", "second"), KEY)
    b = prefix_signature(_pairs(query, "another document"), KEY)
    # 64 B to 512 B lie inside the shared query; 1 KiB reaches past it.
    assert shared_levels(a.digests, b.digests) == 4
    assert shared_levels(a.digests, prefix_signature(_pairs("r" * 1000, "first document"), KEY).digests) == 0
    text = canonical_prompt(_pairs(query, "first document", "second"))
    assert text.index(b"first document") < text.index(b"second")  # pairs in line order
