"""The reasoning and tool parsers on what each published template renders for an assistant turn
(``generated.generated_turn``), tokenised with the family's markers as added tokens under its
published ``special`` flags (or under both flags where those could not be had), decoded as the
worker has the engine decode, and read by the worker into its response message: ``reasoning``
holds the thinking, ``content`` and ``tool_calls`` the answer."""

from __future__ import annotations

import json
import time

import pytest

from conveyor.engine.outputs import RequestMetrics, RequestOutput
from conveyor.engine.sample.token_pieces import TokenPieces
from conveyor.testing.tiny_models import build_tokenizer
from conveyor.worker.execution.engine_host import Completion
from conveyor.worker.execution.item_records import ItemContext, completion_record, sampling_params
from tests.worker.templates.generated import ANSWER, ARGUMENTS, END_OF_TURN, MARKERS, THOUGHT, generated_turn
from tests.worker.templates.ours import our_render, parsed, reasoning_setup
from tests.worker.templates.published import (
    TEMPLATE_FAMILIES,
    published_added_tokens,
    template_of,
    template_tokenizer,
    thinking_controls,
)


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), "qwen3")


def _cases():
    for family in TEMPLATE_FAMILIES:
        flags = [None] if published_added_tokens(family) is not None else [False, True]
        for special in flags:
            for with_call in (False, True):
                label = "published" if special is None else f"special={special}"
                yield pytest.param(
                    family, special, with_call, id=f"{family}-{label}-{'call' if with_call else 'answer'}"
                )


def _tokenizer(base, family: str, special: bool | None):
    tok = template_tokenizer(base, family, [m for m in MARKERS if m in template_of(family)], bool(special))
    missing = [m for m in END_OF_TURN if m not in tok.get_vocab()]
    tok.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    return tok


def _worker_message(tok, family: str, body: dict, generated: str) -> dict:
    """The response message the worker writes for a sample whose tokens are ``generated``'s."""
    req = parsed(body)
    reasoning = reasoning_setup(tok, family)
    params = sampling_params(req, reasoning=reasoning)
    ids = tok.encode(generated, add_special_tokens=False)
    text = tok.decode(ids, skip_special_tokens=params.skip_special_tokens)
    out = RequestOutput(
        "r",
        [1],
        ids,
        text,
        ids,
        text,
        True,
        "stop",
        0,
        RequestMetrics(time.monotonic()),
        prompt=our_render(tok, family, body),
    )
    ctx = ItemContext("job", "model", 0, "worker")
    record = completion_record(ctx, req, Completion("r", [out]), TokenPieces(tok), reasoning=reasoning)
    assert record.response is not None, record.error
    return record.response["choices"][0]["message"]


@pytest.mark.parametrize(("family", "special", "with_call"), list(_cases()))
def test_the_worker_splits_what_the_template_renders(family, special, with_call, base_tokenizer):
    tok = _tokenizer(base_tokenizer, family, special)
    turn = generated_turn(tok, family, with_call)
    assert turn is not None, "the template renders no assistant turn after its own prompt"
    message = _worker_message(tok, family, turn.body, turn.generated)
    # What the template rendered is what the model said: each part it shows must come back
    # in its own field.
    if THOUGHT in turn.generated:
        assert message.get("reasoning") == THOUGHT, (turn.generated, message)
    else:
        assert not message.get("reasoning"), (turn.generated, message)
    calls = message.get("tool_calls") or []
    if with_call and "get_weather" in turn.generated:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", ARGUMENTS)
        ], (turn.generated, message)
    else:
        assert not calls, (turn.generated, message)
    expected_content = ANSWER if ANSWER in turn.generated else None
    assert (message.get("content") or None) == expected_content, (turn.generated, message)


FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "description": "The forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "code": {"type": "string"},
                "hours": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["city"],
        },
    },
}
# A string that reads as a number and values of each JSON type: each comes back as sent.
TYPED = {"city": "Paris", "days": 3, "metric": True, "code": "21", "hours": [6, 18]}


@pytest.mark.parametrize("family", TEMPLATE_FAMILIES)
def test_a_calls_typed_arguments_come_back_as_sent(family, base_tokenizer):
    tok = _tokenizer(base_tokenizer, family, None)
    turn = generated_turn(tok, family, True, FORECAST, TYPED)
    assert turn is not None
    if "forecast" not in turn.generated:
        pytest.skip("the published template renders no past tool call")
    calls = _worker_message(tok, family, turn.body, turn.generated).get("tool_calls") or []
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("forecast", TYPED)], (
        turn.generated
    )


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("family", [f for f in TEMPLATE_FAMILIES if thinking_controls(f)])
def test_with_thinking_off_the_whole_turn_is_the_answer(family, special, base_tokenizer):
    tok = _tokenizer(base_tokenizer, family, special)
    turn = generated_turn(tok, family, False, thinking=(False,))
    assert turn is not None, "the template renders no assistant turn after its own prompt"
    assert ANSWER in turn.generated
    message = _worker_message(tok, family, turn.body, turn.generated)
    assert not message.get("reasoning"), (turn.generated, message)
    assert message.get("content") == ANSWER, (turn.generated, message)
