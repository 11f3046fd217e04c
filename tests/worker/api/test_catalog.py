"""The deployment's model catalog (``CONVEYOR_MODELS``) with no worker running: the official SDK's
batch for a declared model, or one a worker once served, is accepted and waits ``validating``
as demand for that model; ``/v1/models`` lists the catalog with its live workers; an undeclared
model nobody ever served is refused as before. ``conveyor submit`` warns only for the latter."""

from __future__ import annotations

import openai
import pytest

from conveyor.worker.core.settings import ConfigError, read_settings
from conveyor.worker.entrypoints import cli
from conveyor.worker.metrics.exposition import ApiMetrics
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import WorkerState
from conveyor.worker.store.workers import register_worker, set_worker_state
from tests.worker.api_batches import batch_lines
from tests.worker.api_server import ApiServer
from tests.worker.helpers import Scrape, jsonl

DECLARED, RETIRED = "tiny-chat", "org/retired-model"


def test_models_setting_takes_names_separated_by_commas_or_a_json_list(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_MODELS", " Qwen/Qwen3-0.6B, tiny-chat ,s3://bucket/models/x/,tiny-chat")
    assert read_settings().models == ("Qwen/Qwen3-0.6B", "tiny-chat", "s3://bucket/models/x/")
    monkeypatch.setenv("CONVEYOR_MODELS", '["a", "org/b"]')
    assert read_settings().models == ("a", "org/b")
    monkeypatch.delenv("CONVEYOR_MODELS")
    assert read_settings().models == ()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("good, bad name", "'bad name' is not a model name"),
        ("../etc", "'../etc' is not a model name"),
        (",".join(f"m{i}" for i in range(65)), "declares 65 models; at most 64"),
        ("x" * 257, "longer than 256 characters"),
        ('["a", 3]', "must be model names"),
    ],
)
def test_a_bad_catalog_names_the_setting_and_the_entry(monkeypatch, value: str, says: str) -> None:
    monkeypatch.setenv("CONVEYOR_MODELS", value)
    with pytest.raises(ConfigError, match="CONVEYOR_MODELS") as caught:
        read_settings()
    assert says in str(caught.value)


def test_with_no_worker_the_sdk_batch_for_a_declared_or_once_served_model_waits_as_demand(embedded_stack) -> None:
    stack = embedded_stack.with_values(models=[DECLARED], metrics_cache_seconds=0.0)
    server = ApiServer(stack.settings).start()
    db = create_db_engine(stack.settings.database)
    try:
        client = server.client(server.new_key("erin"))
        # A worker served RETIRED once and stopped: work for it is accepted too.
        retired = register_worker(db, RETIRED, "q")
        set_worker_state(db, retired, WorkerState.ready)
        set_worker_state(db, retired, WorkerState.stopped)
        broken = register_worker(db, "org/never-loaded", "q")  # a worker that failed to start serves nothing
        set_worker_state(db, broken, WorkerState.failed, error="no such checkpoint")

        models = {m.id: m for m in client.models.list()}
        assert set(models) == {DECLARED, RETIRED}
        assert {m.model_extra["live_workers"] for m in models.values() if m.model_extra} == {0}
        assert client.models.retrieve(DECLARED).owned_by == "conveyor"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("org/never-loaded")

        created = []
        for model in (DECLARED, RETIRED):
            upload = client.files.create(file=("in.jsonl", jsonl(batch_lines(2, model=model))), purpose="batch")
            batch = client.batches.create(
                input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            assert batch.status == "validating"
            created.append(batch.id)
        metrics = ApiMetrics(stack.settings)
        m = Scrape.parse(metrics.render()[0].decode())
        metrics.close()
        assert m.value("conveyor_demand", model=DECLARED) == 1 and m.value("conveyor_demand", model=RETIRED) == 1
        assert m.value("conveyor_workers_live", model=DECLARED) == 0

        unknown = client.files.create(file=("x.jsonl", jsonl(batch_lines(1, model="org/nobody"))), purpose="batch")
        with pytest.raises(openai.BadRequestError) as caught:
            client.batches.create(input_file_id=unknown.id, endpoint="/v1/chat/completions", completion_window="24h")
        error = caught.value.body
        assert isinstance(error, dict) and error["code"] == "model_not_found" and error["param"] == "model"
        assert error["message"].startswith("The model 'org/nobody' is not served by any live worker (served now: none)")
        assert [b.id for b in client.batches.list()] == created[::-1]
    finally:
        server.stop()
        db.dispose()


def test_submit_refuses_a_model_nobody_declared_unless_allowed(embedded_stack, env, tmp_path, capsys) -> None:
    env(embedded_stack.with_values(models=[DECLARED]))
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(batch_lines(2)))
    assert cli.main(["submit", str(path), "--model", DECLARED]) == 0
    done = capsys.readouterr()
    assert "warning" not in done.err
    assert cli.main(["status", done.out.strip()]) == 0
    assert f"no worker serves model {DECLARED} yet; it is declared (CONVEYOR_MODELS)" in capsys.readouterr().out
    assert cli.main(["submit", str(path), "--model", "org/undeclared"]) == 1
    refused = capsys.readouterr()
    assert refused.out == ""  # no job id: nothing was submitted
    said = "no live worker serves model org/undeclared and CONVEYOR_MODELS does not declare it"
    assert f"{said} (served or declared: {DECLARED})" in refused.err
    assert cli.main(["submit", str(path), "--model", "org/undeclared", "--allow-unserved"]) == 0
    assert "warning: no live worker serves model org/undeclared" in capsys.readouterr().err
