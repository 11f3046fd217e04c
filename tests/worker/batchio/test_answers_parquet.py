"""Answer rows of completion and Responses lines (chat is read back against a real job in
tests/worker/entrypoints/test_follow_lines.py), several row groups, and what is refused."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from conveyor.worker.batchio.answers_parquet import ANSWER_COLUMNS, NotAnswers, write_answers_parquet
from conveyor.worker.batchio.results_parquet import write_results_parquet


def _line(custom_id: str, body: dict) -> bytes:
    return json.dumps({"custom_id": custom_id, "response": {"status_code": 200, "body": body}}).encode() + b"\n"


COMPLETION = {
    "object": "text_completion",
    "choices": [
        {"index": 0, "text": " and a", "finish_reason": "length"},
        {"index": 1, "text": ".", "finish_reason": "stop"},
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3},
}
RESPONSE = {
    "object": "response",
    "status": "completed",
    "output": [
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "content": [{"type": "output_text", "text": "Paris"}]},
        {"type": "function_call", "call_id": "call_1", "name": "look", "arguments": '{"q": 1}'},
    ],
    "usage": {"input_tokens": 9, "output_tokens": 4},
}


def test_completion_and_responses_rows_in_row_groups(tmp_path) -> None:
    out = tmp_path / "answers.parquet"
    lines = [_line("c", COMPLETION), b"\n", _line("r", RESPONSE)]
    export = write_results_parquet(lines, out)
    assert (export.rows, export.what) == (3, "answers")
    table = pq.read_table(out)
    assert table.schema.names == [name for name, _kind in ANSWER_COLUMNS]
    c0, c1, r = table.to_pylist()
    assert (c0["choice"], c0["text"], c0["finish_reason"], c0["prompt_tokens"]) == (0, " and a", "length", 5)
    assert (c1["choice"], c1["text"], c1["finish_reason"], c1["completion_tokens"]) == (1, ".", "stop", 3)
    assert (r["text"], r["reasoning"], r["finish_reason"], r["prompt_tokens"]) == ("Paris", "hmm", "tool_calls", 9)
    call = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"q": 1}'}}
    assert json.loads(r["tool_calls"]) == [call]
    write_answers_parquet([_line(f"c{i}", COMPLETION) for i in range(3)], out, rows_per_group=4)
    assert pq.ParquetFile(out).num_row_groups == 2  # 6 rows, 4 a group


def test_a_line_of_another_kind_is_refused_and_leaves_no_file(tmp_path) -> None:
    out = tmp_path / "answers.parquet"
    with pytest.raises(NotAnswers, match=r"line 2 \('s'\) is a 'rerank' response"):
        write_answers_parquet([_line("c", COMPLETION), _line("s", {"object": "rerank"})], out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "body,kind",
    [
        ({"object": "list", "data": [{"index": 0, "object": "score", "score": 0.5}]}, "'list'"),
        ({"id": "rerank-1", "results": [{"index": 0, "relevance_score": 0.5}]}, "'rerank'"),
    ],
)
def test_score_and_rerank_results_are_refused_with_their_kind(tmp_path, body, kind) -> None:
    with pytest.raises(NotAnswers, match=rf"line 1 \('s'\) is a {kind} response"):
        write_results_parquet([_line("s", body)], tmp_path / "out.parquet")
    assert list(tmp_path.iterdir()) == []
