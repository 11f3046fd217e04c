"""``--model-impl`` on ``conveyor run`` and ``conveyor worker``: it reaches the engine's
``EngineConfig.model_impl`` on top of ``CONVEYOR_ENGINE_ARGS`` (the rest of which is kept)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conveyor.engine.config import MODEL_IMPLS
from conveyor.worker.entrypoints import cli, engine_flags, local_runner
from conveyor.worker.execution.context import WorkerContext, engine_config


class _Stop(Exception):
    """Raised where the command would start the engine: the settings it got are enough."""


def _capture(seen: dict[str, Any]):
    def fake(settings, *args: Any, **kwargs: Any):
        seen["settings"] = settings
        raise _Stop

    return fake


@pytest.fixture
def engine_args_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CONVEYOR_ENGINE_ARGS", json.dumps({"num_kv_blocks": 64, "model_impl": "native"}))


@pytest.mark.parametrize("impl", ["transformers", "auto"])
def test_run_passes_model_impl_to_the_engine_config(impl, engine_args_env, monkeypatch, tmp_path):
    seen: dict[str, Any] = {}
    monkeypatch.setattr(local_runner, "run_job", _capture(seen))
    args = cli.build_parser().parse_args(["run", str(tmp_path / "in.jsonl"), "--model", "m", "--model-impl", impl])
    with pytest.raises(_Stop):
        args.fn(args)
    config = engine_config(seen["settings"], "m")
    assert config.model_impl == impl and config.num_kv_blocks == 64


def test_worker_passes_model_impl_to_the_engine_config(engine_args_env, monkeypatch):
    seen: dict[str, Any] = {}
    monkeypatch.setattr(WorkerContext, "create", _capture(seen))
    args = cli.build_parser().parse_args(["worker", "--model", "org/m", "--model-impl", "transformers"])
    with pytest.raises(_Stop):
        args.fn(args)
    config = engine_config(seen["settings"], "org/m")
    assert config.model_impl == "transformers" and config.num_kv_blocks == 64


def test_without_the_flag_the_environment_decides(engine_args_env, monkeypatch):
    seen: dict[str, Any] = {}
    monkeypatch.setattr(WorkerContext, "create", _capture(seen))
    args = cli.build_parser().parse_args(["worker", "--model", "org/m"])
    with pytest.raises(_Stop):
        args.fn(args)
    assert engine_config(seen["settings"], "org/m").model_impl == "native"


def test_the_choices_are_the_engines_and_a_wrong_one_is_refused(capsys):
    assert engine_flags.MODEL_IMPLS == MODEL_IMPLS
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["worker", "--model", "m", "--model-impl", "jax"])
    assert "--model-impl: invalid choice: 'jax'" in capsys.readouterr().err
