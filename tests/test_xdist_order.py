"""The longest-first list names files that exist, each once, and the hook puts them first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.xdist_order import LONGEST_FIRST, longest_first

ROOT = Path(__file__).resolve().parents[1]


def test_every_named_file_exists_once() -> None:
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [p for p in LONGEST_FIRST if not (ROOT / p).is_file()] == []


def test_named_files_come_first_in_the_lists_order_and_the_rest_keep_theirs() -> None:
    first, second = LONGEST_FIRST[:2]
    ids = ["tests/a.py::x", second + "::p", "tests/b.py::y", first + "::q", second + "::r"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    longest_first(items)  # type: ignore[arg-type]  # only nodeid is read
    assert [i.nodeid for i in items] == [ids[3], ids[1], ids[4], ids[0], ids[2]]
