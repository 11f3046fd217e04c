"""Model ids are made canonical once, and each model gets a broker-safe queue name."""

from __future__ import annotations

import re

import pytest

from conveyor.worker.broker.app import create_app
from conveyor.worker.broker.queues import model_queue, queue_name
from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.model_names import InvalidModel, canonical_model

SAFE = re.compile(r"^[A-Za-z0-9_-]{1,80}$")  # what RabbitMQ, Redis and SQS all accept


def test_local_directories_become_absolute_paths(tmp_path, monkeypatch) -> None:
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert canonical_model("models/tiny") == str((tmp_path / "models" / "tiny").resolve())
    assert canonical_model("./models/tiny/") == canonical_model(str(tmp_path / "models" / "tiny"))


@pytest.mark.parametrize("bad", ["", "  ", "./missing", "/no/such/dir", "a b", "x" * 300, "org/name/extra", "~/nope"])
def test_bad_model_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidModel):
        canonical_model(bad)


def test_a_file_is_not_a_model_unless_gguf(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(InvalidModel, match="is a file"):
        canonical_model(str(tmp_path / "weights.bin"))
    (tmp_path / "m.gguf").write_bytes(b"x")  # a GGUF checkpoint is one file (checked at submit, not here)
    assert canonical_model(str(tmp_path / "m.gguf")) == str((tmp_path / "m.gguf").resolve())


def test_queue_names_are_broker_safe_and_distinct(tmp_path) -> None:
    (tmp_path / "a" / "m").mkdir(parents=True)
    (tmp_path / "b" / "m").mkdir(parents=True)
    names = {
        queue_name(canonical_model("Qwen/Qwen3-0.6B")),
        queue_name(canonical_model("Qwen/Qwen3_0.6B")),
        queue_name(canonical_model(str(tmp_path / "a" / "m"))),
        queue_name(canonical_model(str(tmp_path / "b" / "m"))),
        queue_name(canonical_model("gpt2"), "other"),
    }
    assert len(names) == 5 and all(SAFE.match(n) for n in names), names
    assert queue_name("gpt2") == "conveyor-gpt2"
    assert queue_name("Qwen/Qwen3-0.6B").startswith("conveyor-Qwen_Qwen3-0_6B-")


def test_the_celery_app_is_json_only_with_late_acks_its_model_queue_intake_and_submissions(
    tiny_model, tmp_path
) -> None:
    settings = Settings(home=tmp_path, model=tiny_model, queue_prefix="qtest")
    app = create_app(settings)
    conf = app.conf
    assert conf.accept_content == ["json"] and conf.task_serializer == "json" and conf.result_serializer == "json"
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.worker_pool == "threads"
    name = queue_name(canonical_model(tiny_model), "qtest")
    queues = [q.name for q in conf.task_queues]
    # (the intake queue is consumed by a lane of its own: conveyor.worker.broker.intake_lane)
    assert conf.task_default_queue == name and queues == [name, "qtest-submit"]
    assert model_queue(name).exchange.name == name
    tasks = {"conveyor.run_shard", "conveyor.finalize_job", "conveyor.ingest_job", "conveyor.submit_job"}
    assert tasks <= set(app.tasks)


def test_prefix_must_be_broker_safe() -> None:
    with pytest.raises(ValueError, match="CONVEYOR_QUEUE_PREFIX"):
        Settings(queue_prefix="a.b/c")


def test_engine_args_come_from_json_env_and_unknown_fields_are_named(monkeypatch, tiny_model) -> None:
    from conveyor.worker.core.settings import ConfigError
    from conveyor.worker.execution.context import engine_config

    monkeypatch.setenv("CONVEYOR_ENGINE_ARGS", '{"max_num_seqs": 8, "num_kv_blocks": 64}')
    config = engine_config(Settings(), tiny_model)
    assert config.max_num_seqs == 8 and config.num_kv_blocks == 64
    assert config.scheduling_policy == "priority"  # jobs carry a priority
    with pytest.raises(ConfigError, match=r"unknown field.*max_seqs"):
        engine_config(Settings(engine_args={"max_seqs": 8}), tiny_model)
    with pytest.raises(ConfigError, match=r"CONVEYOR_ENGINE_ARGS: .*block_size"):
        engine_config(Settings(engine_args={"block_size": 3}), tiny_model)


def test_admission_and_the_latency_target_are_engine_args(monkeypatch, tiny_model) -> None:
    from conveyor.worker.core.settings import ConfigError
    from conveyor.worker.execution.context import engine_config

    monkeypatch.setenv("CONVEYOR_ENGINE_ARGS", '{"admission_policy": "predicted", "target_itl_ms": 50}')
    config = engine_config(Settings(), tiny_model)
    assert (config.admission_policy, config.target_itl_ms) == ("predicted", 50)
    with pytest.raises(ConfigError, match=r"CONVEYOR_ENGINE_ARGS: admission_policy must be one of"):
        engine_config(Settings(engine_args={"admission_policy": "oracle"}), tiny_model)
