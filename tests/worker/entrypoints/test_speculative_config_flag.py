"""``conveyor worker --speculative-config JSON``: parsed, laid over CONVEYOR_ENGINE_ARGS, and
checked by the engine's own config before the worker starts."""

from __future__ import annotations

import pytest

from conveyor.engine.spec_decode.config import SpeculativeConfig
from conveyor.worker.core.settings import ConfigError
from conveyor.worker.entrypoints.cli import build_parser
from conveyor.worker.entrypoints.cli.common import engine_overrides, load_settings
from conveyor.worker.execution.context import engine_config


def _worker_args(*argv: str):
    return build_parser().parse_args(["worker", "--model", "m", *argv])


def test_the_flag_joins_the_engine_args(monkeypatch):
    monkeypatch.setenv("CONVEYOR_ENGINE_ARGS", '{"max_num_seqs": 8}')
    args = _worker_args("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    settings = load_settings(**engine_overrides(args))
    assert settings.engine_args == {
        "max_num_seqs": 8,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
    }
    config = engine_config(settings, "m")
    assert config.max_num_seqs == 8
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert engine_overrides(_worker_args()) == {}


def test_bad_values_are_refused_with_the_reason(monkeypatch, capsys):
    monkeypatch.delenv("CONVEYOR_ENGINE_ARGS", raising=False)
    with pytest.raises(SystemExit):
        _worker_args("--speculative-config", "[1, 2]")
    assert "expected a JSON object" in capsys.readouterr().err
    settings = load_settings(**engine_overrides(_worker_args("--speculative-config", '{"method": "medusa"}')))
    with pytest.raises(ConfigError, match=r"speculative_config\.method must be one of"):
        engine_config(settings, "m")
