"""The Python snippets in the README and the docs import what exists: every name a snippet
imports from Conveyor is importable under that name, and none uses the package's old
top-level names (`engine`, `kernels`, `worker`, `migrations`), which are gone."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
OLD_TOP_LEVEL = {"engine", "kernels", "worker", "migrations"}
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def snippet_imports(text: str) -> list[tuple[str, str | None]]:
    """(module, name) for each import in the page's Python blocks; name None for `import m`."""
    found: list[tuple[str, str | None]] = []
    for block in BLOCK.findall(text):
        try:
            tree = ast.parse(block)
        except SyntaxError:
            continue  # a fragment (a call without its surroundings), not a program
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found += [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(alias.name, None) for alias in node.names]
    return found


def test_the_pages_have_python_snippets_to_check() -> None:
    assert sum(len(snippet_imports(p.read_text())) for p in PAGES) >= 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_snippets_import_conveyor_by_its_current_names(page: Path) -> None:
    problems = []
    for module, name in snippet_imports(page.read_text()):
        top = module.partition(".")[0]
        if top in OLD_TOP_LEVEL:
            problems.append(f"{module}: the old top-level name; it is conveyor.{module} now")
        elif top == "conveyor":
            imported = importlib.import_module(module)
            if name is not None and not hasattr(imported, name):
                problems.append(f"from {module} import {name}: no such name")
    assert not problems, "\n".join(problems)


def test_an_old_import_in_a_snippet_is_found() -> None:
    page = "Text\n\n```python\nfrom engine import LLM\nfrom conveyor import LLM\n```\n"
    assert snippet_imports(page) == [("engine", "LLM"), ("conveyor", "LLM")]
