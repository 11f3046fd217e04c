"""``conveyor worker``'s engine flags reach the engine's config, over CONVEYOR_ENGINE_ARGS."""

from __future__ import annotations

import pytest

from conveyor.worker.entrypoints import cli
from conveyor.worker.execution import context


@pytest.fixture
def engine_config_seen(monkeypatch):
    """The EngineConfig the worker would build; the worker stops right after."""
    seen = {}

    def create(cls, settings, model):
        seen["config"] = context.engine_config(settings, model)
        raise cli.UserError("stopped by the test")

    monkeypatch.setattr(context.WorkerContext, "create", classmethod(create))
    return seen


def test_tensor_parallel_size_flag_joins_the_engine_args(engine_config_seen, monkeypatch, capsys) -> None:
    monkeypatch.setenv("CONVEYOR_ENGINE_ARGS", '{"max_num_seqs": 8, "tensor_parallel_size": 4}')
    assert cli.main(["worker", "--model", "org/model", "--tensor-parallel-size", "2"]) == 1
    assert "stopped by the test" in capsys.readouterr().err
    config = engine_config_seen["config"]
    assert (config.tensor_parallel_size, config.max_num_seqs) == (2, 8)


def test_without_the_flag_the_engine_args_decide(engine_config_seen, monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_ENGINE_ARGS", '{"tensor_parallel_size": 3}')
    assert cli.main(["worker", "--model", "org/model"]) == 1
    assert engine_config_seen["config"].tensor_parallel_size == 3


def test_a_bad_size_is_refused_by_the_engines_check_naming_the_flag(engine_config_seen, capsys) -> None:
    assert cli.main(["worker", "--model", "org/model", "--tensor-parallel-size", "0"]) == 1
    err = capsys.readouterr().err
    assert "conveyor: error: --tensor-parallel-size 0: tensor_parallel_size must be a positive integer, got 0" in err
    assert "config" not in engine_config_seen  # refused before the worker's context


def test_cpu_threads_setting_and_flag_reach_the_engine(engine_config_seen, monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_CPU_THREADS", "3")
    assert cli.main(["worker", "--model", "org/model"]) == 1
    assert engine_config_seen["config"].cpu_threads == 3
    assert cli.main(["worker", "--model", "org/model", "--cpu-threads", "2"]) == 1  # the flag wins
    assert engine_config_seen["config"].cpu_threads == 2
    monkeypatch.delenv("CONVEYOR_CPU_THREADS")
    assert cli.main(["worker", "--model", "org/model"]) == 1
    assert engine_config_seen["config"].cpu_threads is None  # the machine decides (conveyor.engine.runner.cpu_threads)


def test_cpu_threads_disagreeing_with_the_engine_args_is_refused(engine_config_seen, monkeypatch, capsys) -> None:
    monkeypatch.setenv("CONVEYOR_ENGINE_ARGS", '{"cpu_threads": 4}')
    assert cli.main(["worker", "--model", "org/model", "--cpu-threads", "2"]) == 1
    err = capsys.readouterr().err
    assert "CONVEYOR_CPU_THREADS=2 and CONVEYOR_ENGINE_ARGS' cpu_threads=4 disagree" in err
    assert "config" not in engine_config_seen


def test_a_bad_cpu_thread_count_names_the_setting(monkeypatch, capsys) -> None:
    monkeypatch.setenv("CONVEYOR_CPU_THREADS", "0")
    assert cli.main(["worker", "--model", "org/model"]) == 1
    assert "CONVEYOR_CPU_THREADS" in capsys.readouterr().err
