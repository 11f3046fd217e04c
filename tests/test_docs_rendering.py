"""Every docs page rendered as the site renders it (mkdocs.yml's Markdown extensions and their
settings, the generated reference pages included) has no list swallowed by a paragraph: a
list needs a blank line before it, or Markdown runs its items into the text above."""

from __future__ import annotations

import re
from collections.abc import Iterator
from html import unescape

import markdown
import pytest

from tests.test_docs import REPO, hook

DOCS = REPO / "docs"
# A line of a paragraph's text that Markdown would have made a list item, had it a blank line above.
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+\S")


def _renderer() -> markdown.Markdown:
    """A Markdown converter with the site's extensions and their settings, from mkdocs.yml."""
    from mkdocs.config import load_config

    config = load_config(str(REPO / "mkdocs.yml"))
    return markdown.Markdown(extensions=config["markdown_extensions"], extension_configs=config["mdx_configs"])


def _pages() -> Iterator[tuple[str, str]]:
    for path in sorted(DOCS.rglob("*.md")):
        yield str(path.relative_to(DOCS)), path.read_text(encoding="utf-8")
    for uri, build in hook().PAGES.items():
        yield uri, build()


PARAGRAPH = re.compile(r"<p\b[^>]*>(.*?)</p>", re.DOTALL)  # (a <p> holds no <p>)
TAG = re.compile(r"<[^>]+>")


def paragraphs(html: str) -> list[str]:
    """The text of each ``<p>``, tags inside it dropped (``<code>``, links...)."""
    return [unescape(TAG.sub("", inner)) for inner in PARAGRAPH.findall(html)]


def swallowed_lists(html: str) -> list[str]:
    """Each paragraph holding a line that starts like a list item, as its first such line."""
    found = []
    for text in paragraphs(html):
        lines = text.splitlines()
        items = [line for line in lines[1:] if LIST_ITEM.match(line)]  # (a paragraph's first line is not a list)
        if items:
            found.append(f"{lines[0][:60]!r} ... {items[0].strip()[:60]!r}")
    return found


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    md = _renderer()
    pages = {}
    for name, text in _pages():
        pages[name] = md.reset().convert(text)
    return pages


def test_no_paragraph_swallows_a_list(rendered) -> None:
    bad = {name: found for name, html in rendered.items() if (found := swallowed_lists(html))}
    assert not bad, "a list needs a blank line before it:\n" + "\n".join(
        f"{name}: {item}" for name, items in bad.items() for item in items
    )


def test_the_check_finds_a_swallowed_list() -> None:
    md = _renderer()
    assert swallowed_lists(md.convert("The job object:\n- `id`: its id\n- `status`: where it is\n")) == [
        "'The job object:' ... '- id: its id'"
    ]
    assert swallowed_lists(md.reset().convert("Steps:\n1. submit\n2. wait\n")) == ["'Steps:' ... '1. submit'"]
    assert swallowed_lists(md.reset().convert("The job object:\n\n- `id`: its id\n- `status`: where it is\n")) == []
    # A wrapped sentence whose next line starts with a number and no dot is prose, not a list.
    assert swallowed_lists(md.reset().convert("It takes about\n30 seconds.\n")) == []


# Wider shell lines overflow the site's code blocks: wrap a command with `\`, put a comment above it.
MAX_SHELL_LINE = 88


def long_shell_lines(text: str) -> list[str]:
    long, language, indent = [], None, 0
    for line in text.splitlines():
        fence = re.match(r"^(\s*)```(\w*)", line)
        if fence:
            language = None if language is not None else fence.group(2)
            indent = len(fence.group(1))  # (a block in a list item: its indent is not shown)
            continue
        if language in ("bash", "sh", "shell", "console") and len(line) - indent > MAX_SHELL_LINE:
            long.append(line)
    return long


def test_shell_lines_fit_the_code_blocks() -> None:
    pages = [*sorted(DOCS.rglob("*.md")), REPO / "README.md", REPO / "CONTRIBUTING.md"]
    bad = {str(p.relative_to(REPO)): found for p in pages if (found := long_shell_lines(p.read_text(encoding="utf-8")))}
    assert not bad, f"shell lines over {MAX_SHELL_LINE} characters: {bad}"
    assert long_shell_lines("```bash\nconveyor run " + "x" * 80 + "\n```\n") != []
    assert long_shell_lines("```text\n" + "x" * 100 + "\n```\n") == []
