"""Our chat rendering equals transformers' ``apply_chat_template`` with each family's
published template, byte for byte, on the conversations of ``published.CONVERSATIONS`` and
with the family's thinking switched off and on."""

from __future__ import annotations

import pytest

from conveyor.testing.tiny_models import build_tokenizer
from tests.worker.templates.ours import our_render
from tests.worker.templates.published import (
    ASK,
    CHECKPOINTS,
    CONVERSATIONS,
    TEMPLATE_FAMILIES,
    template_tokenizer,
    thinking_controls,
    transformers_render,
)


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), "qwen3")


def _cases():
    for family in TEMPLATE_FAMILIES:
        for name, body in CONVERSATIONS.items():
            yield pytest.param(family, body, id=f"{family}-{name}")
        for controls in thinking_controls(family):
            label = "-".join(f"{k}={v}" for k, v in controls.items())
            yield pytest.param(family, {"messages": [ASK], **controls}, id=f"{family}-{label}")


@pytest.mark.parametrize(("family", "body"), list(_cases()))
def test_our_prompt_is_the_published_templates_rendering(family, body, base_tokenizer):
    tok = template_tokenizer(base_tokenizer, family)
    try:
        expected = transformers_render(tok, body)
    except Exception as exc:  # the published template refuses this conversation: so must we
        with pytest.raises(ValueError, match="chat template"):
            our_render(tok, family, body)
        pytest.skip(f"the published template refuses it: {type(exc).__name__}: {exc}")
    assert our_render(tok, family, body) == expected


def test_a_family_without_a_template_is_named_in_the_sources():
    sources = (CHECKPOINTS / "SOURCES.md").read_text()
    named, _, missing = sources.partition("Not found, with where we looked:")
    for family in sorted(p.name for p in CHECKPOINTS.iterdir() if (p / "config.json").is_file()):
        if family in TEMPLATE_FAMILIES:
            assert f"`{family}/chat_template.jinja`" in named, f"{family}'s template has no source"
        else:
            assert f"`{family}/`" in missing, f"{family} has no template and is not named as missing"
