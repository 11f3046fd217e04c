"""Thinking budgets and answer-only grammars in the engine (``conveyor.engine.structured.thinking``), on tiny
Qwen3-architecture models with reasoning templates, greedy tokens checked against transformers."""

from __future__ import annotations

import json

import pytest

from conveyor.engine import SamplingParams
from conveyor.engine.structured.thinking import Delimiters, ThinkingGate
from tests.engine.reasoning_models import OPENS_THINK_TEMPLATE, QWEN3_TEMPLATE, build_reasoning_model
from tests.engine.reference import assert_greedy_match

# Each test builds engines and runs tiny models for seconds (tests/markers.py).
pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "the chef brings soup"}]


@pytest.fixture(scope="module")
def opens_think(tmp_path_factory) -> str:
    return str(build_reasoning_model(tmp_path_factory.mktemp("r1") / "m", OPENS_THINK_TEMPLATE))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return str(build_reasoning_model(tmp_path_factory.mktemp("q3") / "m", QWEN3_TEMPLATE))


def _end_id(llm) -> int:
    (end,) = llm.engine.tokenizer.encode("</think>", add_special_tokens=False)
    return end


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_a_budget_forces_the_end_of_thinking_and_the_line_answers(opens_think, make_llm, hf_reference, budget) -> None:
    llm = make_llm(opens_think)
    end = _end_id(llm)
    (out,) = llm.generate(
        [{"messages": USER}], SamplingParams(max_tokens=20, temperature=0.0, thinking_token_budget=budget)
    )
    prompt = out.prompt_token_ids
    assert llm.engine.tokenizer.decode(prompt).endswith("<think>\n")  # the template opened the block
    thought = out.token_ids[: out.token_ids.index(end)]
    assert len(thought) == budget  # the untouched model does not close it this early on its own
    hf = hf_reference(opens_think)
    assert_greedy_match(thought, hf.greedy(prompt, budget), "thinking")
    # After the forced </think>, the answer is the model's own greedy continuation.
    answer = out.token_ids[budget + 1 :]
    assert answer and "</think>" not in out.text.split("</think>", 1)[1]
    assert_greedy_match(answer, hf.greedy(prompt + thought + [end], len(answer)), "answer")


def test_a_schema_constrains_the_answer_not_the_thinking(opens_think, make_llm, hf_reference) -> None:
    llm = make_llm(opens_think)
    end = _end_id(llm)
    params = SamplingParams(
        max_tokens=40, temperature=0.0, thinking_token_budget=5, structured_outputs={"json": SCHEMA}
    )
    (out,) = llm.generate([{"messages": USER}], params)
    thought, answer = out.text.split("</think>", 1)
    assert json.loads(answer) in ({"ok": True}, {"ok": False}) and out.finish_reason == "stop"
    # The thinking is free (transformers' own greedy tokens), not shaped by the grammar.
    assert_greedy_match(out.token_ids[:5], hf_reference(opens_think).greedy(out.prompt_token_ids, 5), "thinking")
    assert out.token_ids[5] == end and thought


def test_a_template_that_leaves_thinking_to_the_model(qwen3, make_llm) -> None:
    """Qwen3's template does not open the block: with a grammar the opener comes first (the
    format the family answers in), then the budget's thinking, then the constrained answer;
    with ``enable_thinking`` off the template closes an empty block and the grammar starts at once."""
    llm = make_llm(qwen3)
    params = SamplingParams(
        max_tokens=40, temperature=0.0, thinking_token_budget=2, structured_outputs={"json": SCHEMA}
    )
    (on,) = llm.generate([{"messages": USER}], params)
    assert on.text.startswith("<think>") and json.loads(on.text.split("</think>", 1)[1]) in (
        {"ok": True},
        {"ok": False},
    )
    off_prompt = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    (off,) = llm.generate([off_prompt], params)
    assert "<think>\n\n</think>" in llm.engine.tokenizer.decode(off.prompt_token_ids)
    assert json.loads(off.text) in ({"ok": True}, {"ok": False})


def test_preemption_and_the_prefix_cache_mid_thinking(opens_think, make_llm) -> None:
    """A tiny KV cache preempts requests while they think (their tokens are recomputed, and the
    gate, fed only kept tokens, stays in step); a prompt that continues a cached one mid-thought
    starts its gate inside the block. Every line closes its thinking after its budget."""
    roomy = make_llm(opens_think)
    end = _end_id(roomy)
    prompts = [{"messages": [{"role": "user", "content": "the chef brings soup " * (1 + i % 4)}]} for i in range(12)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, thinking_token_budget=3 + i % 5) for i in range(12)]
    expected = roomy.generate(prompts, params)
    tight = make_llm(opens_think, block_size=8, num_kv_blocks=26)
    outs = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    for out, p in zip(outs, params, strict=True):
        assert out.token_ids.index(end) == p.thinking_token_budget
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    # The prefix cache: a prompt that is a first run's prompt and part of its thinking.
    first = expected[0]
    mid = first.prompt_token_ids + first.token_ids[:2]
    (cont,) = roomy.generate([mid], SamplingParams(max_tokens=10, temperature=0.0, thinking_token_budget=1))
    assert cont.num_cached_tokens > 0 and cont.token_ids[1] == end  # one more thought, then the end


def test_the_gate_follows_multi_token_delimiters() -> None:
    """Harmony-like delimiters of several tokens: the opener seen across tokens, the closer
    forced token by token under a spent budget, and the grammar slot empty until then."""
    gate = ThinkingGate(Delimiters((1, 2), (7, 8, 9)), [5, 5], budget=2, inner=None)
    assert gate.state == gate.BEFORE and gate.forced_token() is None
    for t in (1, 2):
        gate.accept(t)
    assert gate.state == gate.THINKING
    gate.accept(40)
    assert gate.forced_token() is None
    gate.accept(41)
    forced: list[int] = []
    while gate.state == gate.THINKING:
        token = gate.forced_token()
        assert token is not None
        forced.append(token)
        gate.accept(token)
    assert forced == [7, 8, 9] and gate.thought == 2 and gate.matcher is None
    # A prompt that closed its block (enable_thinking off) starts in the answer.
    assert ThinkingGate(Delimiters((1,), (2,)), [1, 3, 2], budget=0, inner=None).state == "answer"


def test_bad_thinking_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)
    with pytest.raises(ValueError, match="thinking_delimiters"):
        SamplingParams(thinking_delimiters=("<think>",))  # type: ignore[arg-type]


def test_chat_template_kwargs_are_checked(opens_think, make_llm) -> None:
    llm = make_llm(opens_think)
    for kwargs, words in (({"tokenize": True}, "set by the engine"), ({"a b": 1}, "not a template variable"),
                          ("x", "must be an object")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            llm.engine.add_request("r", {"messages": USER, "chat_template_kwargs": kwargs}, SamplingParams())
    with pytest.raises(ValueError, match="go with messages"):
        llm.engine.add_request("r", {"prompt": "x", "chat_template_kwargs": {}}, SamplingParams())
