"""The generated reference pages: every setting documented from its comment, a setting without
one refused, the CLI and the engine's dataclasses rendered from the code itself."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conveyor.worker.core.settings import Settings
from conveyor.worker.entrypoints.cli import build_parser

REPO = Path(__file__).resolve().parents[1]


def hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reference_pages", REPO / "docs/hooks/reference_pages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_setting_has_a_row_with_its_comment() -> None:
    page = hook().settings_page()
    for name in Settings.model_fields:
        assert f"| `CONVEYOR_{name.upper()}` |" in page, name
    assert "| `CONVEYOR_SHARD_SIZE` | `int` (≥ 1) | `256` | Requests per shard when the submitter names no" in page


def test_a_field_without_a_comment_fails_the_build(tmp_path) -> None:
    source = tmp_path / "settings.py"
    source.write_text(
        "class Settings:\n"
        "    # Documented, over two lines\n"
        "    # of comment.\n"
        "    a: int = 1\n"
        "    # A group heading, not a field's comment.\n"
        "\n"
        "    b: int = 2\n"
        "    c: int = 3  # a trailing comment is not the one above\n"
    )
    assert hook().field_comments(source, "Settings") == {"a": "Documented, over two lines of comment."}


def test_the_settings_page_names_the_fields_without_a_comment(monkeypatch) -> None:
    module = hook()
    real = module.field_comments
    monkeypatch.setattr(
        module, "field_comments", lambda path, cls: {k: v for k, v in real(path, cls).items() if k != "lease_seconds"}
    )
    with pytest.raises(module.ReferenceError, match=r"none for: lease_seconds$"):
        module.settings_page()


def test_the_cli_page_holds_every_commands_help() -> None:
    page = hook().cli_page()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert isinstance(commands, dict)
    for name in commands:
        assert f"## `conveyor {name}`" in page, name
    assert "### `conveyor keys create`" in page and "### `conveyor db upgrade`" in page


@dataclasses.dataclass
class Cache:
    # Tokens per KV block.
    block_size: int = 16


@dataclasses.dataclass
class Config:
    # The checkpoint.
    model: str = "m"
    cache: Cache = dataclasses.field(default_factory=Cache)


def test_engine_config_renders_nested_groups() -> None:
    """EngineConfig may group its fields into dataclasses: each group gets a section."""
    lines = hook()._dataclass_section(Config, "Fields", 2, "")
    text = "\n".join(lines)
    assert '| `model` | `str` | `"m"` | The checkpoint. |' in text
    assert "### `cache`: `Cache`" in text and "| `cache.block_size` | `int` | `16` | Tokens per KV block. |" in text


def test_engine_config_and_sampling_params_pages_list_every_field() -> None:
    from conveyor.engine.config import SPECULATIVE_FLAT, EngineConfig
    from conveyor.engine.sampling_params import SamplingParams
    from conveyor.engine.spec_decode.config import SpeculativeConfig

    module = hook()
    engine_page, sampling_page = module.engine_config_page(), module.sampling_params_page()
    for name in EngineConfig.flat_field_names() - {SPECULATIVE_FLAT}:
        assert f"| `{name}` |" in engine_page, name
    assert f"`{SPECULATIVE_FLAT}`" in engine_page
    for f in dataclasses.fields(SpeculativeConfig):
        if f.init:
            assert f"| `{f.name}` |" in engine_page, f.name
    for f in dataclasses.fields(SamplingParams):
        if f.init:
            assert f"| `{f.name}` |" in sampling_page, f.name
