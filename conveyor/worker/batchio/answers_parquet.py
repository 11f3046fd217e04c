"""A job's chat, completion or Responses results (or its errors) as Parquet: one row per
answer (a line asking ``n`` > 1 has ``n``), streamed a row group at a time.

The schema (``ANSWER_COLUMNS``) is the docs' table in ``user-guide/batch-jobs.md``. A
Responses answer is read into the same columns: its ``output_text`` parts as ``text``, its
reasoning items as ``reasoning``, its function calls as chat ``tool_calls``, and its status as
a finish reason (``length`` when incomplete, ``tool_calls`` when it called one, else ``stop``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

from conveyor.worker.batchio.parquet_file import ROWS_PER_GROUP, RowGroupWriter, Target, write_whole
from conveyor.worker.core.terminal_text import shown_id

# (name, pyarrow type name): the columns, in order.
ANSWER_COLUMNS = (
    ("custom_id", "string"),
    ("choice", "int32"),
    ("status", "string"),
    ("status_code", "int32"),
    ("text", "string"),
    ("reasoning", "string"),
    ("tool_calls", "string"),
    ("finish_reason", "string"),
    ("prompt_tokens", "int64"),
    ("completion_tokens", "int64"),
    ("error_code", "string"),
    ("error_message", "string"),
)


class NotAnswers(ValueError):
    """A results line that is no chat, completion or Responses answer."""


@dataclass(frozen=True)
class AnswerRow:
    custom_id: str
    status: str  # succeeded | failed
    choice: int | None = None
    status_code: int | None = None
    text: str | None = None
    reasoning: str | None = None
    tool_calls: str | None = None  # JSON: the chat ``tool_calls`` list
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error_code: str | None = None
    error_message: str | None = None


def answer_schema() -> Any:
    import pyarrow as pa

    return pa.schema([(name, getattr(pa, kind)()) for name, kind in ANSWER_COLUMNS])


def write_answers_parquet(lines: Iterable[bytes], out: Target, rows_per_group: int = ROWS_PER_GROUP) -> int:
    """Write a results or errors file's ``lines`` to ``out`` as answer rows; their number. A
    path gets the whole file or nothing."""
    return write_whole(out, lambda target: _write(lines, target, rows_per_group))


def _write(lines: Iterable[bytes], out: str | BinaryIO, rows_per_group: int) -> int:
    writer = RowGroupWriter(out, answer_schema(), rows_per_group)
    count = 0
    try:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            for row in answer_rows(number, json.loads(line)):
                writer.append(asdict(row))
                count += 1
    finally:
        writer.close()
    return count


def answer_rows(number: int, record: dict[str, Any]) -> Iterator[AnswerRow]:
    """The rows of one output line (``number``: its place in the file, for errors)."""
    custom_id = str(record.get("custom_id"))
    response = record.get("response") or {}
    body = response.get("body") or {}
    status_code = response.get("status_code")
    error = record.get("error") or body.get("error")
    if error:  # rejected at validation (``error``), or ran and failed (an HTTP error body)
        code, message = error.get("code"), error.get("message")
        yield AnswerRow(custom_id, "failed", status_code=status_code, error_code=code, error_message=message)
        return
    kind = body.get("object") or ("rerank" if "results" in body else None)  # (a rerank response has no object)
    if kind in ("chat.completion", "text_completion"):
        usage = body.get("usage") or {}
        tokens = {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens")}
        for choice in body.get("choices") or []:
            message = choice.get("message") or {}
            calls = message.get("tool_calls")
            yield AnswerRow(
                custom_id, "succeeded", choice=choice.get("index"), status_code=status_code,
                text=message.get("content") if kind == "chat.completion" else choice.get("text"),
                reasoning=message.get("reasoning", message.get("reasoning_content")),
                tool_calls=json.dumps(calls, ensure_ascii=False) if calls else None,
                finish_reason=choice.get("finish_reason"), **tokens,
            )  # fmt: skip
        return
    if kind == "response":
        yield _response_row(custom_id, status_code, body)
        return
    raise NotAnswers(
        f"line {number} ({shown_id(custom_id)}) is {'a ' + repr(kind) if kind else 'no'} response: Parquet holds "
        "chat, completion, Responses and embeddings results"
    )


def _response_row(custom_id: str, status_code: int | None, body: dict[str, Any]) -> AnswerRow:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in body.get("output") or []:
        kind = item.get("type")
        if kind == "message":
            texts += [p.get("text") or "" for p in item.get("content") or [] if p.get("type") == "output_text"]
        elif kind == "reasoning":
            thoughts += [p.get("text") or "" for p in item.get("content") or [] if p.get("type") == "reasoning_text"]
        elif kind == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments")}
            calls.append({"id": item.get("call_id"), "type": "function", "function": function})
    finish = "length" if body.get("status") == "incomplete" else "tool_calls" if calls else "stop"
    usage = body.get("usage") or {}
    return AnswerRow(
        custom_id, "succeeded", choice=0, status_code=status_code,
        text="".join(texts) if texts else None, reasoning="".join(thoughts) if thoughts else None,
        tool_calls=json.dumps(calls, ensure_ascii=False) if calls else None, finish_reason=finish,
        prompt_tokens=usage.get("input_tokens"), completion_tokens=usage.get("output_tokens"),
    )  # fmt: skip
