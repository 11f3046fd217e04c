"""Structured outputs on tiny random-weight models, whose unconstrained output is garbage: every
constrained output must still parse and validate, however it was scheduled."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import pytest
import torch

from conveyor.engine import SamplingParams, StructuredOutputs
from conveyor.engine.structured.structured_outputs import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, StructuredOutputManager
from tests.engine.helpers import record_steps
from tests.engine.reference import oracle_model
from tests.structured_schemas import SCHEMAS, validate

MAX_TOKENS = 300
NAMES = sorted(SCHEMAS)


def _prompts(n: int) -> list[str]:
    return [f"Describe order {i} of table {i % 7} as JSON." for i in range(n)]


def _json_params(name: str, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=StructuredOutputs(json=SCHEMAS[name]), **kw)


def _check(outs, names: list[str]) -> None:
    for out, name in zip(outs, names, strict=True):
        assert out.finish_reason == "stop", (name, out.finish_reason, out.error, out.text)
        validate(out.text, SCHEMAS[name])


@pytest.fixture
def llm(tiny_models, make_llm):
    return make_llm(tiny_models("qwen2"))


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_every_schema_validates_in_a_batch_of_32(llm, sampling) -> None:
    names = [NAMES[i % len(NAMES)] for i in range(32)]
    kw = {"temperature": 0.0} if sampling == "greedy" else {"temperature": 1.0}
    params = [_json_params(name, **kw, **({"seed": i} if sampling == "seeded" else {})) for i, name in enumerate(names)]
    outs = llm.generate(_prompts(32), params)
    _check(outs, names)
    assert len(set(NAMES) - set(names)) == 0 and len(NAMES) >= 20


def test_every_schema_validates_alone_and_as_in_a_batch(llm) -> None:
    """Batch size 1, greedy: the same output as inside a batch (rows do not leak into each other)."""
    prompts = _prompts(len(NAMES))
    batched = llm.generate(prompts, [_json_params(n, temperature=0.0) for n in NAMES])
    for prompt, name, together in zip(prompts, NAMES, batched, strict=True):
        (alone,) = llm.generate([prompt], _json_params(name, temperature=0.0))
        _check([alone], [name])
        assert alone.token_ids == together.token_ids, name


def test_seeded_sampling_is_reproducible_and_unconstrained_output_is_not_json(llm) -> None:
    prompts = _prompts(8)
    params = [_json_params("classification", temperature=1.0, seed=i) for i in range(8)]
    first, second = llm.generate(prompts, params), llm.generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    _check(first, ["classification"] * 8)
    free = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=1.0, seed=0))
    assert not any(_parses(o.text) for o in free)  # the model alone writes garbage


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_n_samples_each_follow_the_schema(llm) -> None:
    (prompt,) = _prompts(1)
    params = [_json_params("refs", temperature=1.0, seed=3, n=4), _json_params("nested", n=3)]
    outs = llm.generate([prompt, prompt], params)
    assert [o.index for o in outs] == [0, 1, 2, 3, 0, 1, 2]
    _check(outs, ["refs"] * 4 + ["nested"] * 3)
    assert len({o.text for o in outs[:4]}) > 1


def test_preemption_keeps_the_matcher_in_step(tiny_models, make_llm) -> None:
    """A tiny KV cache preempts requests mid-output; their tokens are recomputed, not re-sampled,
    and the greedy outputs equal those of an engine with room for all."""
    path = tiny_models("qwen2")
    names = [NAMES[i % len(NAMES)] for i in range(16)]
    params = [_json_params(n, temperature=0.0) for n in names]
    roomy = make_llm(path).generate(_prompts(16), params)
    tight = make_llm(path, block_size=8, num_kv_blocks=24)
    outs = tight.generate(_prompts(16), params)
    assert tight.engine.stats().num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    _check(outs, names)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_chunked_prefill_masks_only_the_rows_that_sample(tiny_models, make_llm, monkeypatch) -> None:
    path = tiny_models("qwen2")
    long_prompts = [" ".join(["the waiter brings soup to table"] * (3 + i)) for i in range(6)]
    names = NAMES[:6]
    params = [_json_params(n, temperature=0.0) for n in names]
    whole = make_llm(path).generate(long_prompts, params)
    llm = make_llm(path, max_num_batched_tokens=16, max_num_seqs=6)
    steps = record_steps(monkeypatch, llm.engine.scheduler)
    masked_rows: list[int] = []
    apply = llm.engine.structured.apply_masks

    def counting(logits, reqs):
        masked_rows.append(sum(r.grammar is not None for r in reqs))
        assert logits.shape[0] == len(reqs)  # only rows that sample a token reach the sampler
        return apply(logits, reqs)

    monkeypatch.setattr(llm.engine.structured, "apply_masks", counting)
    outs = llm.generate(long_prompts, params)
    _check(outs, names)
    assert any(n > 1 and c + n < t for s in steps for c, n, t in s)  # some prefill was chunked
    assert sum(masked_rows) == sum(len(o.token_ids) for o in outs)  # one mask per sampled token
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole]


def test_prefix_caching_with_constrained_requests(llm) -> None:
    prompt = "A long shared system prompt about the kitchen, the chef and the waiter. " * 4
    params = _json_params("booleans", temperature=1.0, seed=1)
    first = llm.generate([prompt + "first"], params)
    again = llm.generate([prompt + "second", prompt + "third"], [params, _json_params("enum")])
    assert all(o.num_cached_tokens > 0 for o in again)
    _check(first + again, ["booleans", "booleans", "enum"])


def test_choice_and_regex_match_exactly(llm) -> None:
    choices = ["yes", "no", "not sure", 'a "quoted" one', "back\\slash", "über"]
    regexes = [r"[A-Z]{3}-[0-9]{4}", r"(red|green|blue) (cat|dog)", r"[a-f]{2,5}@[0-9]\.com", r"-?[1-9][0-9]{0,2}"]
    params = [
        SamplingParams(max_tokens=64, temperature=1.0, seed=i, structured_outputs=StructuredOutputs(choice=choices))
        for i in range(12)
    ] + [
        SamplingParams(max_tokens=64, temperature=t, seed=i, structured_outputs=StructuredOutputs(regex=rx))
        for i, rx in enumerate(regexes)
        for t in (0.0, 1.0)
    ]
    outs = llm.generate(_prompts(len(params)), params)
    for out in outs[:12]:
        assert out.text in choices and out.finish_reason == "stop"
    assert len({o.text for o in outs[:12]}) > 2
    for out, rx in zip(outs[12:], [rx for rx in regexes for _ in (0, 1)], strict=True):
        assert re.fullmatch(rx, out.text), (rx, out.text)


def test_lark_and_gbnf_grammars(llm) -> None:
    lark = 'start: "order " NUMBER " of " DISH\nNUMBER: /[1-9][0-9]?/\nDISH: "soup" | "bread" | "cake"'
    gbnf = 'root ::= ("tea" | "coffee") " with " ("milk" | "lemon")'
    outs = llm.generate(
        _prompts(4),
        [
            SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs=StructuredOutputs(grammar=g))
            for g in (lark, gbnf)
            for s in (0, 1)
        ],
    )
    for out in outs[:2]:
        assert re.fullmatch(r"order [1-9][0-9]? of (soup|bread|cake)", out.text), out.text
    for out in outs[2:]:
        assert re.fullmatch(r"(tea|coffee) with (milk|lemon)", out.text), out.text


def test_json_object_and_a_schema_given_as_text(llm) -> None:
    outs = llm.generate(
        _prompts(2),
        [
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs={"json_object": True}),
            SamplingParams(max_tokens=MAX_TOKENS, structured_outputs={"json": json.dumps(SCHEMAS["matrix"])}),
        ],
    )
    for out in outs:
        assert out.finish_reason in ("stop", "length")
    assert isinstance(json.loads(outs[1].text), dict)
    validate(outs[1].text, SCHEMAS["matrix"])
    if outs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[0].text), dict)
    else:
        assert outs[0].text.startswith("{")


def test_eos_only_once_the_grammar_is_complete(llm) -> None:
    """``[0-9]{3,}`` can end after 3 digits: the model may stop with EOS from then on, never before."""
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=s, structured_outputs={"regex": "[0-9]{3,}"})
        for s in range(16)
    ]
    for out in llm.generate(_prompts(16), params):
        assert re.fullmatch("[0-9]{3,}", out.text), out.text
        if out.finish_reason == "stop":
            assert len(out.token_ids) >= 1 and out.stop_reason in llm.engine.eos_token_ids
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_one_compile_per_schema_and_a_bounded_cache(tiny_models, make_llm) -> None:
    llm = make_llm(tiny_models("qwen2"))
    structured = llm.engine.structured
    llm.generate(_prompts(40), _json_params("enum", max_tokens=20))
    assert (structured.stats.misses, structured.stats.hits) == (1, 39)
    structured._cache_size = 3
    for name in NAMES[:5]:
        structured.compile(StructuredOutputs(json=SCHEMAS[name]))
    assert structured.cache_len() == 3
    structured.compile(StructuredOutputs(json=SCHEMAS[NAMES[4]]))  # still cached: a hit
    assert structured.stats.misses == 6


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "Invalid type: strin"),
        ({"json": {"type": "object", "not": {"required": ["a"]}}}, 'Unimplemented keys: ["not"]'),
        ({"json": {"type": "string", "pattern": "(unclosed"}}, "regex parse error"),
        ({"json": {"$ref": "#/$defs/missing"}}, "does not exist"),
        ({"regex": "[a-z"}, "unclosed character class"),
        ({"grammar": "start: undefined_rule"}, "unknown name"),
    ],
)
def test_what_the_library_refuses_fails_that_request_alone(llm, constraint, words) -> None:
    good = _json_params("flat", temperature=0.0)
    bad = SamplingParams(max_tokens=20, structured_outputs=constraint)
    outs = llm.generate(_prompts(3), [good, bad, good])
    assert outs[1].finish_reason == "error" and words in (outs[1].error or ""), outs[1].error
    assert outs[1].error.startswith(f"structured_outputs.{next(iter(constraint))}: cannot compile")
    _check([outs[0], outs[2]], ["flat", "flat"])
    with pytest.raises(ValueError, match="cannot compile"):  # cached failure: same message
        llm.engine.add_request("again", "x", bad)


def _deep(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"choice": []}, "non-empty list"),
        ({"choice": ["ok", ""]}, "non-empty strings"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1, 2]}, "JSON Schema object"),
        ({"json": {"enum": ["x" * 1000] * (MAX_SCHEMA_BYTES // 1000 + 1)}}, f"at most {MAX_SCHEMA_BYTES}"),
        ({"json": _deep(MAX_SCHEMA_DEPTH + 1)}, f"more than {MAX_SCHEMA_DEPTH} levels"),
        ({"regex": ""}, "non-empty string"),
        ({}, "exactly one of"),
        ({"json": {}, "regex": "a"}, "exactly one of"),
    ],
)
def test_bad_constraints_are_value_errors_naming_the_field(kwargs, words) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(structured_outputs=StructuredOutputs(**kwargs))
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=kwargs)


def test_the_mask_never_allows_padded_vocabulary_ids(tiny_models) -> None:
    """The logits can be wider than the tokenizer (padded embeddings): those ids stay at -inf."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models("qwen2"))
    width = len(tok) + 37
    manager = StructuredOutputManager(tok, width, [tok.eos_token_id])
    grammar = manager.compile(StructuredOutputs(json_object=True))

    class Row:
        def __init__(self, g) -> None:
            self.grammar = g

    logits = torch.zeros(3, width)
    masked = manager.apply_masks(logits, [Row(grammar.matcher()), Row(None), Row(grammar.matcher())])
    assert torch.isinf(masked[0, len(tok) :]).all() and torch.isinf(masked[2, len(tok) :]).all()
    assert (masked[1] == 0).all()  # an unconstrained row is untouched
    allowed = (~torch.isinf(masked[0])).nonzero().flatten().tolist()
    assert allowed and all(str(tok.decode([t])).lstrip().startswith("{") for t in allowed)


def test_greedy_output_equals_transformers_masked_by_llguidance(tiny_models, make_llm) -> None:
    """A reference that is not our engine: transformers' float32 logits, masked step by step by
    llguidance's own matcher (built here from the same schema), argmax. Tokens are compared up to
    the first near-tie of the masked logits (two float32 implementations may break it apart)."""
    from transformers import AutoTokenizer

    path = tiny_models("qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    model = oracle_model(path)
    llm = make_llm(path)
    eos = sorted(llm.engine.eos_token_ids)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=model.config.vocab_size, eos_token=eos)  # type: ignore[arg-type]
    names = ["flat", "refs", "number_bounds", "int_array", "classification", "pattern"]
    prompts = _prompts(len(names))
    outs = llm.generate(prompts, [_json_params(n, temperature=0.0) for n in names])
    compared = 0
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMAS[name], separators=(",", ":")), defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(lltok, grammar)
        ids = tok(prompt).input_ids
        words = (lltok.vocab_size + 31) // 32
        ref: list[int] = []
        with torch.no_grad():
            while not matcher.is_stopped() and len(ref) < MAX_TOKENS:
                logits = model(torch.tensor([ids + ref])).logits[0, -1].float()
                mask = torch.zeros(words, dtype=torch.int32)
                matcher.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
                bits = ((mask.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[: logits.shape[0]]
                masked = logits.masked_fill(bits == 0, float("-inf"))
                top = masked.topk(2).values
                token = int(masked.argmax())
                if out.token_ids[len(ref)] != token:
                    assert top[0] - top[1] < 1e-3, (name, len(ref), out.text)  # only a near-tie may differ
                    break
                ref.append(token)
                compared += 1
                assert matcher.consume_token(token)
                if token in eos:
                    break
            else:
                assert out.token_ids == ref, name
        validate(out.text, SCHEMAS[name])
    assert compared > 100
