"""``LLM.chat``, as vLLM has it: the chat template applied to each conversation, then the
same tokens ``generate`` gives for the rendered prompt (float32, greedy), itself checked
against transformers."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.engine.reference import assert_greedy_match, greedy

CONVERSATIONS = [
    [{"role": "user", "content": "The chef brings warm bread to the guest"}],
    [
        {"role": "system", "content": "You are a waiter."},
        {"role": "user", "content": "One two three"},
        {"role": "assistant", "content": "four five"},
        {"role": "user", "content": "six seven"},
    ],
]
MAX_TOKENS = [12, 9]


def _rendered_ids(model: str, conversation: list[dict[str, str]], **kwargs) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids: Any = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # (a BatchEncoding in transformers 5)


def test_chat_gives_generates_tokens_for_the_rendered_template(tiny_models, make_llm, hf_reference):
    model = tiny_models("llama")
    llm = make_llm(model)
    params = greedy(MAX_TOKENS)
    chats = llm.chat(CONVERSATIONS, params)
    rendered = [_rendered_ids(model, c) for c in CONVERSATIONS]
    plain = llm.generate(rendered, params)
    assert [o.prompt_token_ids for o in chats] == rendered
    assert [o.token_ids for o in chats] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "length" and o.error is None for o in chats)
    # And generate's tokens are transformers' own.
    ref = hf_reference(model)
    for out, ids, n in zip(chats, rendered, MAX_TOKENS, strict=True):
        assert_greedy_match(out.token_ids, ref.greedy(ids, n), label=repr(ids))


def test_one_conversation_is_one_output(tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"))
    [alone] = llm.chat(CONVERSATIONS[0], greedy([5]))
    [first, _] = llm.chat(CONVERSATIONS, greedy([5, 5]))
    assert alone.token_ids == first.token_ids and len(alone.token_ids) == 5


@pytest.fixture
def templated_model(tiny_models, tmp_path):
    """The tiny Llama with a template that reads a variable, as Qwen3's ``enable_thinking``."""
    path = tmp_path / "templated"
    shutil.copytree(tiny_models("llama"), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{% if greeting %}{{ greeting }} {% endif %}"
    )
    tokenizer.save_pretrained(path)
    return str(path)


def test_chat_template_kwargs_reach_the_template(templated_model, make_llm):
    llm = make_llm(templated_model)
    kwargs = {"greeting": "hot soup"}
    [plain] = llm.chat(CONVERSATIONS[0], greedy([4]))
    [greeted] = llm.chat(CONVERSATIONS[0], greedy([4]), chat_template_kwargs=kwargs)
    assert greeted.prompt_token_ids == _rendered_ids(templated_model, CONVERSATIONS[0], **kwargs)
    assert greeted.prompt_token_ids != plain.prompt_token_ids
    assert greeted.prompt.endswith("assistant\nhot soup ")


def test_bad_conversations_are_refused_per_conversation_or_by_name(tiny_models, make_llm):
    llm = make_llm(tiny_models("llama"))
    # A conversation the template cannot take fails alone, as a batch line does.
    bad, good = llm.chat([[{"content": "no role"}], CONVERSATIONS[0]], greedy([3, 3]))
    assert bad.finish_reason == "error" and "messages[0] must be an object with a string 'role'" in bad.error
    assert good.finish_reason == "length"
    # The engine's own template variables are not a request's to set.
    [reserved] = llm.chat(CONVERSATIONS[0], greedy([3]), chat_template_kwargs={"add_generation_prompt": False})
    assert "'add_generation_prompt' is set by the engine" in reserved.error
    with pytest.raises(ValueError, match="messages must be a list of message objects"):
        llm.chat({"role": "user", "content": "hi"})
    with pytest.raises(ValueError, match=r"messages\[1\] must be a conversation"):
        llm.chat([CONVERSATIONS[0], "one two"])
