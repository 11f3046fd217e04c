"""A chat line's path through the worker and the engine up to its rendered prompt, as a
shard runs it: validated (``request_from_object``), stored and read back as JSON, made the
engine's prompt (``engine_prompt`` with the worker's reasoning setup), rendered by the
engine's input stage."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from conveyor.engine.inputs.processor import InputProcessor
from conveyor.engine.pooling.pooler import EngineEmbedding
from conveyor.engine.structured.structured_outputs import StructuredOutputManager
from conveyor.worker.batchio.records import ParsedRequest, request_from_object
from conveyor.worker.batchio.request_body import CHAT
from conveyor.worker.core.limits import InputLimits
from conveyor.worker.execution.item_records import engine_prompt
from conveyor.worker.execution.reasoning import Reasoning
from tests.worker.templates.published import CHECKPOINTS


@cache
def model_type(family: str) -> str:
    return json.loads((CHECKPOINTS / family / "config.json").read_text())["model_type"]


def reasoning_setup(tok: Any, family: str) -> Reasoning:
    return Reasoning.for_model("auto", tok, model_type(family))


def parsed(body: dict[str, Any]) -> ParsedRequest:
    line = {"custom_id": "line-1", "method": "POST", "url": CHAT, "body": body}
    req = request_from_object(line, 1, InputLimits())
    return ParsedRequest.from_json(json.loads(json.dumps(req.to_json())))


def our_render(tok: Any, family: str, body: dict[str, Any]) -> str:
    """The prompt text the engine tokenises for this chat body."""
    processor = InputProcessor(
        tok,
        len(tok),
        1 << 20,
        "test",
        StructuredOutputManager(tok, len(tok), frozenset({tok.eos_token_id})),
        EngineEmbedding(None, 64, "no pooling in these tests"),
    )
    prompt = engine_prompt(parsed(body), chat_template=True, reasoning=reasoning_setup(tok, family))
    _, text = processor.tokenize(prompt)
    assert text is not None
    return text
