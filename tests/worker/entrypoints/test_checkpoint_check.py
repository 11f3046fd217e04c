"""A job for a local checkpoint that no worker could load is refused at submit, with the
reason, and nothing is created: a corrupt config.json, an unsupported architecture, missing
or damaged weights, no tokenizer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import func, select

from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.store.models import Job
from tests.worker.helpers import jsonl, openai_lines


def _break_config(model: Path) -> None:
    (model / "config.json").write_text('{"model_type": "llama",')


def _unsupported(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))


def _no_weights(model: Path) -> None:
    for file in model.glob("*.safetensors"):
        file.unlink()


def _damaged_weights(model: Path) -> None:
    for file in model.glob("*.safetensors"):
        file.write_bytes(b"\x00" * 64)


def _no_tokenizer(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"):
        (model / name).unlink(missing_ok=True)


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "corrupt config.json": (_break_config, "config.json is not valid JSON"),
    "unsupported architecture": (_unsupported, "model_type 'mamba' is not supported"),
    "no weights": (_no_weights, "has no *.safetensors weights"),
    "damaged weights": (_damaged_weights, ".safetensors is not a readable safetensors file"),
    "no tokenizer": (_no_tokenizer, "has no tokenizer files"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_submit_refuses_a_local_checkpoint_no_worker_could_load(case, embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    model = tmp_path / "model"
    shutil.copytree(stack.model, model)
    breaker, words = CASES[case]
    breaker(model)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(2)))
    assert main(["submit", str(path), "--model", str(model)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"conveyor: error: model {model} cannot be loaded: "), err
    assert words in err and "\n" not in err
    with Client(stack.settings) as client, client.db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_a_loadable_local_checkpoint_is_accepted(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(openai_lines(2)))
    assert main(["submit", str(path), "--model", stack.model]) == 0
    assert capsys.readouterr().out.strip().startswith("batch_")
