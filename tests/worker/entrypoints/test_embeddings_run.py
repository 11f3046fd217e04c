"""``/v1/embeddings`` batches through ``conveyor run``: OpenAI's line shapes in (a string, a
list of strings, token ids, lists of token ids; ``dimensions``; ``encoding_format`` float and
base64), OpenAI's ``CreateEmbeddingResponse`` out, with vectors equal to sentence-transformers'
``encode``; plain rows with an ``input`` column; a bad line or a model that cannot embed gives
each line a clear error and the job goes on."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.worker.entrypoints.cli import main
from tests.engine.embedding_helpers import (
    TEXTS,
    assert_same_vectors,
    reference_vectors,
    sentence_transformers_encoder,
    sentence_transformers_model,
)
from tests.worker.helpers import Stack, make_values, parse_lines
from tests.worker.openai_shapes import check_output_line

ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 16, "dtype": "float32", "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def st_root(tmp_path_factory):
    return tmp_path_factory.mktemp("st-models")


def _line(custom_id: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body})


def _run(env, tmp_path: Path, model: str, lines: list[str], capsys, rc: int = 0) -> tuple[list[dict], list[dict]]:
    env(Stack(make_values(tmp_path / "home", model, engine_args=dict(ENGINE)), model))
    path, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["run", str(path), "--model", model, "-o", str(out), "--errors", str(err), "-q"]) == rc, (
        capsys.readouterr().err
    )
    results, errors = out.read_text().splitlines(), err.read_text().splitlines()
    for line in results:
        check_output_line(line, results=True)
    for line in errors:
        check_output_line(line, results=False)
    return parse_lines(results), parse_lines(errors)


def _vectors(body: dict[str, Any]) -> list[list[float]]:
    out = []
    for i, item in enumerate(body["data"]):
        assert item["index"] == i and item["object"] == "embedding"
        vec = item["embedding"]
        if isinstance(vec, str):  # base64: little-endian float32, as OpenAI sends it
            raw = base64.b64decode(vec)
            vec = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        out.append(vec)
    return out


def test_run_embeds_every_input_shape_as_sentence_transformers_does(st_root, env, tmp_path, capsys) -> None:
    model = sentence_transformers_model(st_root, "qwen3", "last", True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = [tok.encode(t) for t in TEXTS[:2]]
    lines = [
        _line("one", {"model": "m", "input": TEXTS[0]}),
        _line("many", {"model": "m", "input": TEXTS, "user": "u-1"}),
        _line("ids", {"input": ids[0]}),
        _line("ids-list", {"input": ids, "encoding_format": "base64"}),
        _line("short", {"input": TEXTS[2:4], "dimensions": 16, "encoding_format": "float"}),
        _line("empty", {"input": ""}),
        _line("too-big", {"input": TEXTS[0], "dimensions": 1000}),
    ]
    results, errors = _run(env, tmp_path, model, lines, capsys)
    by_id = {r["custom_id"]: r["response"]["body"] for r in results}
    assert sorted(by_id) == ["ids", "ids-list", "many", "one", "short"]
    ref = reference_vectors(model, TEXTS)
    assert_same_vectors(_vectors(by_id["one"]), ref[:1])
    assert_same_vectors(_vectors(by_id["many"]), ref)
    assert_same_vectors(_vectors(by_id["ids"]), ref[:1])
    assert_same_vectors(_vectors(by_id["ids-list"]), ref[:2])
    assert_same_vectors(_vectors(by_id["short"]), reference_vectors(model, TEXTS[2:4], 16))
    assert by_id["many"]["usage"] == {"prompt_tokens": sum(len(tok.encode(t)) for t in TEXTS)} | {
        "total_tokens": sum(len(tok.encode(t)) for t in TEXTS)
    }
    failed = {e["custom_id"]: e for e in errors}
    assert sorted(failed) == ["empty", "too-big"]
    assert "input[0] is empty" in failed["empty"]["error"]["message"]
    too_big = failed["too-big"]["response"]["body"]["error"]["message"]
    assert "dimensions must be at most the model's embedding size 64" in too_big


def test_run_embeds_with_an_encoder_and_an_input_over_the_step_budget_fails_alone(
    st_root, env, tmp_path, capsys
) -> None:
    model = sentence_transformers_encoder(st_root, "xlm-roberta", "cls", True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    budget = 32  # ENGINE's max_num_batched_tokens
    fits = [t for t in TEXTS if len(tok.encode(t)) <= budget]
    too_long = next(t for t in TEXTS if len(tok.encode(t)) > budget)
    lines = [
        _line("texts", {"input": fits}),
        _line("short", {"input": fits[0], "dimensions": 16, "encoding_format": "base64"}),
        _line("long", {"input": [fits[0], too_long]}),
    ]
    results, errors = _run(env, tmp_path, model, lines, capsys)
    by_id = {r["custom_id"]: r["response"]["body"] for r in results}
    assert sorted(by_id) == ["short", "texts"]
    assert_same_vectors(_vectors(by_id["texts"]), reference_vectors(model, fits))
    assert_same_vectors(_vectors(by_id["short"]), reference_vectors(model, fits[:1], 16))
    [failed] = errors
    assert failed["custom_id"] == "long"
    assert "max_num_batched_tokens" in json.dumps(failed)


def test_plain_rows_with_an_input_column_are_embedded(st_root, env, tmp_path, capsys) -> None:
    model = sentence_transformers_model(st_root, "qwen3", "mean", False)
    lines = [json.dumps({"id": f"r{i}", "input": t, "note": "ignored"}) for i, t in enumerate(TEXTS)]
    results, errors = _run(env, tmp_path, model, lines, capsys)
    assert not errors
    got = {r["custom_id"]: _vectors(r["response"]["body"])[0] for r in results}
    assert_same_vectors([got[f"r{i}"] for i in range(len(TEXTS))], reference_vectors(model, TEXTS))


def test_a_model_that_cannot_embed_answers_each_line_with_the_reason(st_root, env, tmp_path, capsys) -> None:
    model = Path(sentence_transformers_model(st_root, "qwen3", "last", True))
    broken = tmp_path / "max-pooling"
    broken.mkdir()
    for f in model.iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    (broken / "1_Pooling").mkdir()
    (broken / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    lines = [_line(f"e{i}", {"input": t}) for i, t in enumerate(TEXTS[:3])]
    results, errors = _run(env, tmp_path, str(broken), lines, capsys, rc=1)  # the job ends; all lines failed
    assert not results and len(errors) == 3
    for e in errors:
        message = e["response"]["body"]["error"]["message"]
        assert "this model cannot embed" in message and "pooling_mode_max_tokens" in message


def test_base64_and_float_carry_the_same_numbers() -> None:
    from conveyor.worker.batchio.embeddings_body import encode_vector

    vec = torch.randn(8).tolist()
    encoded = encode_vector(vec, "base64")
    assert isinstance(encoded, str)
    raw = base64.b64decode(encoded)
    assert list(struct.unpack("<8f", raw)) == pytest.approx(vec, rel=1e-6)
    assert encode_vector(vec, "float") == vec


def test_results_export_as_parquet_one_row_per_vector(st_root, env, tmp_path, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from conveyor.worker.batchio.embeddings_parquet import write_embeddings_parquet
    from conveyor.worker.entrypoints.client import Client

    model = sentence_transformers_model(st_root, "qwen3", "last", True)
    lines = [_line("a", {"input": TEXTS}), _line("b", {"input": TEXTS[0], "encoding_format": "base64"})]
    results, _ = _run(env, tmp_path, model, lines, capsys)
    job = Client().jobs(limit=1)[0]["id"]
    out = tmp_path / "vectors.parquet"
    assert main(["results", job, "--format", "parquet", "-o", str(out)]) == 0
    table = pq.read_table(out)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 64)
    rows = table.to_pylist()
    want = [(r["custom_id"], i, v) for r in results for i, v in enumerate(_vectors(r["response"]["body"]))]
    assert [(r["custom_id"], r["index"]) for r in rows] == [(c, i) for c, i, _ in want]
    for row, (_, _, vec) in zip(rows, want, strict=True):
        assert row["embedding"] == pytest.approx(vec, rel=1e-6)
    # Streamed a row group at a time: memory holds one group, whatever the job's size.
    small = tmp_path / "small.parquet"
    raw = [json.dumps(r).encode() + b"\n" for r in results]
    assert write_embeddings_parquet(raw, small, rows_per_group=2) == len(rows)
    assert pq.ParquetFile(small).num_row_groups == 3
    assert main(["results", job, "--format", "parquet"]) != 0  # no -o
    assert "give -o FILE" in capsys.readouterr().err
