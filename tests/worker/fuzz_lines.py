"""Hostile input lines for the robustness tests: a hypothesis strategy of JSON text, and a
seeded generator of whole input files mixing valid requests with every kind of garbage."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

# Fields the readers look at (plus "body", which makes a line an OpenAI Batch line).
FIELDS = [
    "custom_id", "id", "prompt", "messages", "body", "method", "url", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "stop_token_ids", "logprobs", "top_logprobs",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "best_of", "stream", "metadata",
    "role", "content", "type", "text",
]  # fmt: skip

_any_char = st.characters(categories=["L", "M", "N", "P", "S", "Z", "C"])  # "C" includes lone surrogates


def json_text(max_leaves: int = 8) -> st.SearchStrategy[str]:
    """JSON text (not always valid): huge and odd numbers, deep nesting, escaped lone
    surrogates and control characters, long strings, objects keyed by the fields we read."""
    scalars = st.one_of(
        st.sampled_from(["null", "true", "false", "NaN", "Infinity", "-Infinity", "1e999", "-0", "0.5", "1"]),
        st.integers().map(str),
        st.integers(1, 6000).map(lambda n: "9" * n),  # past Python's 4,300-digit int-string limit
        st.integers(1, 400).map(lambda n: "-" + "1" * n + ".5"),
        st.floats().map(json.dumps),
        st.text(_any_char, max_size=40).map(json.dumps),
        st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
        st.integers(1, 20_000).map(lambda n: json.dumps("x" * n)),
    )

    def containers(kids: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        keys = st.one_of(st.sampled_from(FIELDS), st.text(_any_char, max_size=6))
        return st.one_of(
            st.lists(kids, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
            st.dictionaries(keys, kids, max_size=4).map(
                lambda d: "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in d.items()) + "}"
            ),
        )

    return st.recursive(scalars, containers, max_leaves=max_leaves)


# ---- a seeded input file ----------------------------------------------------------------------


def _valid(rng: random.Random, i: int) -> dict:
    body: dict = {"max_tokens": rng.choice([1, 2]), "temperature": 0}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": f"soup {i}\u0001\u00e9"}]
        url = "/v1/chat/completions"
    else:
        body["prompt"] = f"The chef {i} \t\u2603 says"
        url = "/v1/completions"
    return {"custom_id": f"ok-{i}", "method": "POST", "url": url, "body": body}


def _huge_number(rng: random.Random, i: int) -> bytes:
    digits = "9" * rng.choice([20, 400, 4301, 10_000])
    field = rng.choice(["max_tokens", "top_p", "temperature", "seed", "top_k", "stop_token_ids", "prompt"])
    value = f"[{digits}]" if field in ("stop_token_ids", "prompt") else digits
    sign = rng.choice(["", "-"])
    return f'{{"custom_id": "bad-{i}", "prompt": "p", "{field}": {sign}{value}}}'.encode()


def _deep(rng: random.Random, i: int) -> bytes:
    depth = rng.choice([50, 900, 5000, 10_000])  # the last is over the tests' 16 KiB line limit
    nest = "[" * depth + "]" * depth
    lines = [nest, f'{{"prompt": "p", "stop": {nest}}}', f'{{"custom_id": "bad-{i}", "body": {nest}}}']
    return rng.choice(lines).encode()


def _surrogate(rng: random.Random, i: int) -> bytes:
    s = '"a\\ud800b"'
    return rng.choice(
        [
            f'{{"custom_id": "bad-{i}", "prompt": {s}}}',
            f'{{"custom_id": "bad-{i}", "messages": [{{"role": "user", "content": {s}}}]}}',
            f'{{"custom_id": "bad-{i}", "prompt": "p", "stop": [{s}]}}',
            f'{{"custom_id": {s}, "prompt": "p"}}',
        ]
    ).encode()


def _wrong_type(rng: random.Random, i: int) -> bytes:
    field = rng.choice(FIELDS[2:])  # not the ids: a result must name its line
    value = rng.choice(['"x"', "[]", "{}", "true", "null", "-1", "1.5", '[{"role": 5}]'])
    return f'{{"custom_id": "bad-{i}", "prompt": "p", "{field}": {value}}}'.encode()


def _invalid_json(rng: random.Random, i: int) -> bytes:
    return rng.choice([b"{", b'{"prompt": }', b"nope", b'{"prompt": "a"} x', b"\xff\xfe{}", b"{'prompt': 1}"])


def _control(rng: random.Random, i: int) -> bytes:
    char = chr(rng.choice([0, 1, 7, 8, 27, 127]))
    return rng.choice([f'{{"prompt": "a{char}b"}}', f"\x0c{char}{{}}"]).encode()


def _long_string(rng: random.Random, i: int) -> bytes:
    n = rng.choice([100, 5_000, 20_000])  # the last is over the tests' 16 KiB line limit
    return json.dumps({"custom_id": f"bad-{i}", "prompt": "p", "stop": "s" * n}).encode()


def _random_bytes(rng: random.Random, i: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))).replace(b"\n", b"?")


_GARBAGE: list[Callable[[random.Random, int], bytes]] = [
    _huge_number, _deep, _surrogate, _wrong_type, _invalid_json, _control, _long_string, _random_bytes,
]  # fmt: skip


@dataclass
class FuzzFile:
    data: bytes
    line_numbers: list[int]  # of the non-blank lines
    valid: int  # runnable requests among them (garbage may turn out runnable too)

    def line_of(self, custom_id: str) -> int:
        """The line a result's custom_id came from ("ok-<i>"/"bad-<i>": the i-th line)."""
        if custom_id.startswith("line-"):
            return int(custom_id.removeprefix("line-"))
        return self.line_numbers[int(custom_id.rpartition("-")[2])]


def fuzz_file(lines: int, valid: int, seed: int) -> FuzzFile:
    """``lines`` non-blank lines (``valid`` of them runnable requests), seeded; blank lines
    and ``\\r\\n`` endings scattered in between."""
    rng = random.Random(seed)
    valid_at = set(rng.sample(range(lines), valid))
    out: list[bytes] = []
    fuzz = FuzzFile(b"", [], valid)
    for i in range(lines):
        if rng.random() < 0.02:
            out.append(rng.choice([b"\n", b"   \n", b"\t\r\n"]))
        if i in valid_at:
            line = json.dumps(_valid(rng, i), ensure_ascii=rng.random() < 0.5).encode()
        else:
            line = rng.choice(_GARBAGE)(rng, i)
        if not line.strip():
            line = b"{}"  # keep the count exact: every generated line is non-blank
        out.append(line + rng.choice([b"\n", b"\r\n"]))
        fuzz.line_numbers.append(len(out))
    fuzz.data = b"".join(out)
    return fuzz
