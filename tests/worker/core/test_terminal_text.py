"""Users' text printed on a terminal: nothing in it a terminal acts on."""

from __future__ import annotations

import json

from conveyor.worker.core.terminal_text import json_for_terminal, printable, shown_id

HOSTILE = "\x1b]0;owned\x07\x1b[2J\x9b31m\x7fend"


def test_ids_are_shown_quoted_and_escaped() -> None:
    shown = shown_id(HOSTILE)
    assert shown == "'\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\x7fend'"
    assert shown.isprintable() and shown_id(None) == "None" and shown_id("req-1") == "'req-1'"


def test_messages_keep_their_text_and_lines_but_no_control() -> None:
    assert printable("plain text, ünïcode") == "plain text, ünïcode"
    text = printable(f"custom_id {HOSTILE} failed\n\tsecond line")
    assert text == "custom_id \\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\x7fend failed\n\tsecond line"
    assert not any(c in text for c in "\x1b\x07\x9b\x7f")


def test_a_json_line_for_a_terminal_is_the_same_json_without_raw_controls() -> None:
    line = (json.dumps({"custom_id": HOSTILE, "text": "ok ü"}, ensure_ascii=False) + "\n").encode()
    assert b"\xc2\x9b" in line and b"\x7f" in line  # what JSON leaves raw
    shown = json_for_terminal(line)
    assert json.loads(shown) == json.loads(line) and shown.endswith(b"\n")
    assert not any(c in shown.decode() for c in "\x1b\x07\x9b\x7f")
    plain = b'{"custom_id":"req-1"}\n'
    assert json_for_terminal(plain) is plain
