"""``chat_template_kwargs``: names the tokenizer or ``apply_chat_template`` set are refused."""

from __future__ import annotations

import pytest

from conveyor.engine.inputs.chat_kwargs import check_template_kwargs


@pytest.mark.parametrize(
    "name", ["pad_token", "unk_token", "additional_special_tokens", "sanitize_control_tokens", "bos_token", "tokenize"]
)
def test_reserved_names_are_refused_naming_the_variable(name: str) -> None:
    with pytest.raises(ValueError, match=f"chat_template_kwargs: '{name}' is set by the engine, not by a request"):
        check_template_kwargs({"enable_thinking": False, name: "<|im_end|>"})


def test_a_template_variable_of_the_request_passes() -> None:
    kwargs = {"enable_thinking": False, "reasoning_effort": "low", "pad": 1}
    assert check_template_kwargs(kwargs) == kwargs
