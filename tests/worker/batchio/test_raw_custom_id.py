"""A line that is not JSON still names its error by the ``custom_id`` its text shows, when
one can be read from it without guessing; otherwise by ``line-<n>``."""

from __future__ import annotations

import io
import json

import pytest

from conveyor.worker.batchio.raw_custom_id import custom_id_from_text
from conveyor.worker.batchio.readers import iter_input
from conveyor.worker.batchio.records import LineError
from conveyor.worker.core.limits import MAX_CUSTOM_ID_CHARS, InputLimits
from conveyor.worker.entrypoints.cli import main
from tests.worker.helpers import jsonl, openai_lines

URL = '"method": "POST", "url": "/v1/chat/completions"'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"custom_id": "abc", ' + URL + ', "body": {"messages": [}', "abc"),  # a torn body
        ('{"body": {"max_tokens": 3,}, "custom_id":"req-7"}', "req-7"),  # after the damage, no spaces
        ('{ "custom_id" :\t"caf\\u00e9 \\"quoted\\" \\ud83d\\ude00", "body": }', 'café "quoted" 😀'),
        ('{"custom_id": "a\\/b\\\\c"', "a/b\\c"),  # cut off after it
    ],
)
def test_the_custom_id_is_read_and_unescaped(text, expected):
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # each is a line json cannot parse
    assert custom_id_from_text(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        '{"custom_id": 7, "body": }',  # not a string
        '{"custom_id": "", "body": }',  # empty
        '{"custom_id": "a", "custom_id": "b", "body": }',  # two: which one?
        '{"custom_id": "a", "body": {"custom_id": "a"}, }',  # even the same one twice
        '{"body": {"content": "say \\"custom_id\\": \\"x\\""}, }',  # inside a string, not a key
        '{"note": "custom_id": "x"}',  # not where a key stands
        '{"custom_id": "unterminated, "body": }',  # the value's end is not where a string ends
        '{"custom_id": "bad \\q escape"}',
        '{"custom_id": "lone \\ud800 surrogate"}',
        '{"custom_id": "nul \\u0000 inside"}',
        '{"custom_id": "tab\there"}',  # a raw control character: not a JSON string
        '{"custom_id": "' + "x" * (MAX_CUSTOM_ID_CHARS + 1) + '", }',  # over the limit
        '{"custom_id": "' + "\\u00e9" * (2 * MAX_CUSTOM_ID_CHARS) + '", }',
    ],
)
def test_nothing_is_guessed(text):
    assert custom_id_from_text(text) is None


def test_the_limit_is_the_deployments():
    assert custom_id_from_text('{"custom_id": "abcdef", }', max_chars=5) is None
    assert custom_id_from_text('{"custom_id": "abcde", }', max_chars=5) == "abcde"


def _errors(data: bytes) -> list[LineError]:
    return [r for r in iter_input(io.BytesIO(data), InputLimits()) if isinstance(r, LineError)]


def test_the_reader_names_malformed_lines_by_their_custom_id():
    good = jsonl(openai_lines(1))
    data = (
        good
        + b'{"custom_id": "abc", ' + URL.encode() + b', "body": {"messages": [}\n'  # line 2
        + b'{"prompt": "no id at all" \n'  # line 3
        + b'{"custom_id": "latin-\xe9", "body": }\n'  # line 4: not UTF-8, in the id itself
        + b'{"custom_id": "ok-id", "body": "\xff"}\n'  # line 5: not UTF-8, elsewhere
    )  # fmt: skip
    found = [(e.line, e.code, e.custom_id) for e in _errors(data)]
    assert found == [
        (2, "invalid_json", "abc"),
        (3, "invalid_json", None),
        (4, "invalid_encoding", None),
        (5, "invalid_encoding", "ok-id"),
    ]


def test_a_run_names_the_malformed_line_in_its_errors_file(embedded_stack, env, tmp_path):
    stack = env(embedded_stack)
    src, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    src.write_bytes(jsonl(openai_lines(1)) + b'{"custom_id": "abc", ' + URL.encode() + b', "body": {"messages": [}\n')
    assert main(["run", str(src), "--model", stack.model, "-q", "-o", str(out), "--errors", str(err)]) == 0
    [error] = [json.loads(line) for line in err.read_text().splitlines()]
    assert error["custom_id"] == "abc"
    assert error["error"]["code"] == "invalid_json" and error["error"]["line"] == 2
