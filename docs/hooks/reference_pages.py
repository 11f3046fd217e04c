"""MkDocs hook: the reference pages, generated from the code at build time, and the benchmark plots.

Nothing is written to ``docs/``: the pages exist only in the build. Each reference is read
from its source of truth: the CLI from ``build_parser()``, every ``CONVEYOR_*`` setting from
``conveyor.worker.core.settings.Settings`` (its meaning is the comment above the field: a field
without one fails the build), ``EngineConfig`` and ``SamplingParams`` from their dataclasses
(nested dataclass groups, if ``EngineConfig`` has them, get a section each).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the checkout being documented, not an installed copy
    sys.path.insert(0, str(REPO))

PLOTS = REPO / "benchmarks" / "results"


class ReferenceError(Exception):
    """The code cannot be documented as it stands (the message says which field and why)."""


# ---- comments above fields -------------------------------------------------------------


def field_comments(source_file: Path, class_name: str) -> dict[str, str]:
    """``{field: comment}`` for the annotated fields of ``class_name`` in ``source_file``: the
    ``#`` lines directly above each field (no blank line between), joined; fields with none are
    absent."""
    text = source_file.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise ReferenceError(f"{source_file}: no class {class_name}")
    comments: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        block: list[str] = []
        i = node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            block.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        if block:
            comments[node.target.id] = " ".join(block)
    return comments


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    if isinstance(value, Path):
        value = str(value)
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return "`" + text.replace("`", "'") + "`"


# ---- settings --------------------------------------------------------------------------


def _bounds(info: Any) -> str:
    parts = []
    for item in getattr(info, "metadata", ()):
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value}")
    return ", ".join(parts)


def settings_page() -> str:
    from conveyor.worker.core import settings as module

    cls = module.Settings
    comments = field_comments(Path(inspect.getfile(module)), "Settings")
    missing = [name for name in cls.model_fields if name not in comments]
    if missing:
        raise ReferenceError(
            "conveyor/worker/core/settings.py: every setting needs a one-line comment directly above it (the settings "
            f"reference is built from them); none for: {', '.join(missing)}"
        )
    source = Path(inspect.getfile(module)).read_text()
    annotations = {
        n.target.id: ast.unparse(n.annotation)
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    rows = []
    for name, info in cls.model_fields.items():
        if info.default_factory is not None:
            default = _code(info.default_factory())  # type: ignore[call-arg]
        elif info.default is None:
            default = "unset"
        else:
            default = _code(info.default)
        kind = annotations.get(name, "")
        if kind.startswith("Annotated["):
            kind = kind[len("Annotated[") :].split(",")[0]
        bounds = _bounds(info)
        kind = f"`{kind}`" + (f" ({bounds})" if bounds else "")
        rows.append(f"| `CONVEYOR_{name.upper()}` | {_cell(kind)} | {_cell(default)} | {_cell(comments[name])} |")
    return "\n".join(
        [
            "# Settings",
            "",
            "Every setting is an environment variable, `CONVEYOR_` and the field's name in capitals, read by",
            "`conveyor.worker.core.settings.Settings` (pydantic-settings). Command-line flags, where a command has",
            "one, win over the variable. A value that cannot be used is one `conveyor: error: invalid settings: ...`",
            "line naming the variable. With nothing set, everything lives under `CONVEYOR_HOME`: a SQLite",
            "database, a local object store and a SQLite-backed broker.",
            "",
            f"This page is generated from the settings class at build time ({len(rows)} settings).",
            "",
            "| variable | type | default | meaning |",
            "| --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )


# ---- dataclasses (EngineConfig, SamplingParams) ----------------------------------------


def _dataclass_section(cls: type, heading: str, level: int, prefix: str) -> list[str]:
    comments = field_comments(Path(inspect.getfile(cls)), cls.__name__)
    hints = typing.get_type_hints(cls)
    source_annotations = {
        n.target.id: ast.unparse(n.annotation)
        for n in ast.walk(ast.parse(inspect.getsource(cls)))
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    rows: list[str] = []
    groups: list[tuple[str, type]] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        hint = hints.get(f.name)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            groups.append((f.name, hint))
        if f.default is not dataclasses.MISSING:
            default = _code(f.default) if f.default is not None else "`None`"
        elif f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()
            default = f"`{type(made).__name__}()`" if dataclasses.is_dataclass(made) else _code(made)
        else:
            default = "required"
        meaning = comments.get(f.name, "")
        kind = source_annotations.get(f.name, str(hint))
        rows.append(f"| `{prefix}{f.name}` | `{_cell(kind)}` | {_cell(default)} | {_cell(meaning)} |")
    out = [f"{'#' * level} {heading}", ""]
    doc = inspect.getdoc(cls)
    if doc and not doc.startswith(f"{cls.__name__}("):  # dataclasses' generated signature says nothing
        out += [doc, ""]
    out += ["| field | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    for name, group in groups:
        out += _dataclass_section(group, f"`{prefix}{name}`: `{group.__name__}`", level + 1, f"{prefix}{name}.")
    return out


def engine_config_page() -> str:
    from conveyor.engine.config import GROUPS, SPECULATIVE_FLAT
    from conveyor.engine.spec_decode.config import SpeculativeConfig

    intro = [
        "# EngineConfig",
        "",
        "`conveyor.engine.EngineConfig` holds every option of the engine, in groups: `model`, `cache`, `scheduler`,",
        "`parallel` and `speculative`. `LLM(model, **fields)` takes every field below as a flat keyword",
        "argument; a worker takes them as JSON in `CONVEYOR_ENGINE_ARGS` (for example",
        '`{"max_num_seqs": 128, "scheduling_policy": "edf"}`), and speculative decoding as one',
        f"`{SPECULATIVE_FLAT}` object with the fields of its group. A value the engine cannot use is a",
        "`ValueError` naming the field. Generated from the groups' dataclasses at build time.",
        "",
    ]
    sections = _engine_flags_section()
    for name, group in GROUPS.items():
        sections += _dataclass_section(group, f"`{name}`: `{group.__name__}`", 2, "")
    sections += _dataclass_section(
        SpeculativeConfig, f"`speculative`: `SpeculativeConfig` (the `{SPECULATIVE_FLAT}` object)", 2, ""
    )
    return "\n".join(intro + sections)


def _engine_flags_section() -> list[str]:
    """The command-line flags (``conveyor.worker.entrypoints.engine_flags``): each flag's field,
    what the field means (its comment in ``conveyor.engine.config``) and where vLLM differs."""
    from conveyor.engine.config import GROUPS, SPECULATIVE_FLAT
    from conveyor.worker.entrypoints.engine_flags import ENGINE_FLAGS

    meanings: dict[str, str] = {}
    for group in GROUPS.values():
        meanings.update(field_comments(Path(inspect.getfile(group)), group.__name__))
    meanings[SPECULATIVE_FLAT] = "speculative decoding: an object with the fields of the `speculative` group below"
    rows = []
    for flag in ENGINE_FLAGS:
        option = f"`{flag.option}`" + (f" / `--no-{flag.option[2:]}`" if flag.boolean else "")
        if flag.field not in meanings:
            raise ReferenceError(f"engine flag {flag.option}: EngineConfig has no field {flag.field!r}")
        rows.append(f"| {option} | `{flag.field}` | {_cell(meanings[flag.field])} | {_cell(flag.vllm_note)} |")
    return [
        "## Command-line flags",
        "",
        "`conveyor run` and `conveyor worker` take these fields as flags, under vLLM's names. A flag sets the",
        "same field as `CONVEYOR_ENGINE_ARGS`, wins over it, and is checked the same way: a bad value is",
        "refused, naming the flag, before the model loads. `conveyor serve` takes none: it runs the HTTP API",
        "and builds no engine (the workers do). Fields without a flag are set in `CONVEYOR_ENGINE_ARGS`.",
        "",
        "| flag | field | meaning | unlike vLLM |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
    ]


def sampling_params_page() -> str:
    from conveyor.engine.sampling_params import SamplingParams
    from conveyor.engine.structured.structured_outputs import StructuredOutputs

    intro = [
        "# SamplingParams",
        "",
        "`conveyor.engine.SamplingParams`: how to sample one request, for `LLM.generate` and",
        "`LLMEngine.add_request`. The batch API's request bodies are translated into it",
        "(see [Batch jobs](../user-guide/batch-jobs.md)). Generated from the dataclass at build time.",
        "",
    ]
    out = intro + _dataclass_section(SamplingParams, "Fields", 2, "")
    out += _dataclass_section(StructuredOutputs, "StructuredOutputs", 2, "")
    return "\n".join(out)


# ---- the CLI ---------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    found: list[tuple[str, str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name, ""), sub))
    return found


def cli_page() -> str:
    from conveyor.worker.entrypoints.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal: the page must not depend on it
    parser = build_parser()
    out = [
        "# Command line",
        "",
        "`conveyor` and every command's options, generated from the argument parser",
        "(`conveyor.worker.entrypoints.cli.build_parser`) at build time. Every command prints the same with `--help`.",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
        "",
    ]

    def walk(p: argparse.ArgumentParser, path: str, level: int) -> None:
        for name, help_text, sub in _subcommands(p):
            out.extend([f"{'#' * level} `{path} {name}`", "", help_text.capitalize() + "." if help_text else "", ""])
            out.extend(["```text", sub.format_help().rstrip(), "```", ""])
            walk(sub, f"{path} {name}", level + 1)

    walk(parser, "conveyor", 2)
    return "\n".join(out)


PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_page,
    "reference/settings.md": settings_page,
    "reference/engine-config.md": engine_config_page,
    "reference/sampling-params.md": sampling_params_page,
}


# ---- the hook --------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    for uri, build in PAGES.items():
        try:
            content = build()
        except ReferenceError as exc:
            raise PluginError(str(exc)) from None
        files.append(File.generated(config, uri, content=content))
    for plot in sorted(PLOTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/plots/{plot.name}", abs_src_path=str(plot)))
    return files


def on_config(config: Any) -> Any:
    """Pages under ``operations/`` that the nav does not name yet (one added by another change)
    join the Operations section, so a new page needs no edit here to be reachable."""
    docs = Path(config["docs_dir"])
    for entry in config["nav"] or []:
        if isinstance(entry, dict) and "Operations" in entry:
            listed = set(entry["Operations"])
            for page in sorted((docs / "operations").glob("*.md")):
                uri = f"operations/{page.name}"
                if uri not in listed:
                    entry["Operations"].append(uri)
    return config
