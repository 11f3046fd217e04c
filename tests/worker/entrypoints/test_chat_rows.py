"""Plain rows as chat: ``prompt`` rows through the model's chat template, ``messages`` columns in
CSV and Parquet, ``--system-prompt``, and the sampling flags as defaults under each line's own
fields, through ``conveyor run``, the queued path (``conveyor submit`` and a worker) and the
broker contract. The rendered prompt is checked against the tokenizer's own template: the
token count of the prompt the engine ran (``usage.prompt_tokens``) and, for rows asking for
``echo``, its text, so a template applied twice or not at all shows."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
from typing import Any

import pytest

from conveyor.worker.batchio.readers import iter_input
from conveyor.worker.batchio.records import InputFormat, LineError, ParsedRequest
from conveyor.worker.batchio.request_body import COMPLETIONS
from conveyor.worker.batchio.request_options import RequestOptions
from conveyor.worker.broker.submission_contract import InvalidSubmission, parse_submission
from conveyor.worker.broker.submissions import handle_submission
from conveyor.worker.core.limits import InputLimits
from conveyor.worker.core.settings import Settings
from conveyor.worker.entrypoints.cli import main
from conveyor.worker.entrypoints.client import Client
from conveyor.worker.execution.item_records import engine_prompt
from conveyor.worker.jobs import object_keys
from conveyor.worker.jobs.submission import ingest_job
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.objects.local import LocalStore
from conveyor.worker.store.schema import upgrade_database
from tests.worker.helpers import REPO, parse_lines, read_object

SYSTEM = "You are a waiter in a busy kitchen."
OWN_SYSTEM = "Answer in one word."
SCHEMA = {"type": "object", "properties": {"dish": {"type": "string"}}, "required": ["dish"]}


def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _rendered(tok: Any, messages: list[dict[str, str]]) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _count(tok: Any, text: str, *, special: bool = False) -> int:
    return len(tok.encode(text, add_special_tokens=special))


def _csv(rows: list[dict[str, Any]]) -> bytes:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, ["custom_id", "prompt", "messages", "echo", "temperature"])
    writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, bool)) else v for k, v in row.items()})
    return buf.getvalue().encode()


ROWS: list[dict[str, Any]] = [
    {"custom_id": "p-echo", "prompt": "Tell the chef about the soup", "echo": True},
    {"custom_id": "p-plain", "prompt": "Bring the bread to the table"},
    {"custom_id": "m-user", "messages": [{"role": "user", "content": "Serve the tea"}]},
    {
        "custom_id": "m-own-system",
        "messages": [{"role": "system", "content": OWN_SYSTEM}, {"role": "user", "content": "Pour the water"}],
    },
    {"custom_id": "p-hot", "prompt": "Taste the cake", "temperature": 1.5},
]


def _expected_prompts(system: str | None) -> dict[str, list[dict[str, str]]]:
    """custom_id -> the messages the chat template must render (the system prompt first when
    the row has none of its own)."""
    first = [{"role": "system", "content": system}] if system else []
    return {
        "p-echo": [*first, {"role": "user", "content": "Tell the chef about the soup"}],
        "p-plain": [*first, {"role": "user", "content": "Bring the bread to the table"}],
        "m-user": [*first, {"role": "user", "content": "Serve the tea"}],
        "m-own-system": [{"role": "system", "content": OWN_SYSTEM}, {"role": "user", "content": "Pour the water"}],
        "p-hot": [*first, {"role": "user", "content": "Taste the cake"}],
    }


def _check_rendered(tok: Any, results: list[dict[str, Any]], system: str | None) -> None:
    expected = _expected_prompts(system)
    assert sorted(r["custom_id"] for r in results) == sorted(expected)
    for r in results:
        body = r["response"]["body"]
        rendered = _rendered(tok, expected[r["custom_id"]])
        assert rendered.count("<|im_start|>assistant") == 1
        assert body["usage"]["prompt_tokens"] == _count(tok, rendered), r["custom_id"]
        # prompt rows answer as completions, chat or not; messages rows as chat completions
        assert body["object"] == ("text_completion" if r["custom_id"].startswith("p-") else "chat.completion")
    echo = next(r for r in results if r["custom_id"] == "p-echo")["response"]["body"]
    for choice in echo["choices"]:  # echo: what the model saw, once, then what it wrote
        text = choice["text"]
        assert text.startswith(_rendered(tok, expected["p-echo"]))
        assert text.count("<|im_start|>user") == 1 and text.count(SYSTEM) == (1 if system else 0)


def _shard_sampling(settings: Settings, job_id: str, data: bytes, fmt: InputFormat) -> dict[str, dict[str, Any]]:
    """custom_id -> the sampling fields the engine gets: the job's recorded options applied to
    its input by intake's reader (the job's shard files were deleted when it ended)."""
    options = RequestOptions.from_json(Client(settings).status(job_id)["request_options"])
    rows = iter_input(io.BytesIO(data), InputLimits(), fmt, options)
    return {r.custom_id: r.sampling for r in rows if isinstance(r, ParsedRequest)}


# ---- the reader: columns, system prompt, defaults ------------------------------------------


def _read(data: bytes, fmt: str, options: RequestOptions) -> list[ParsedRequest | LineError]:
    return list(iter_input(io.BytesIO(data), InputLimits(), fmt, options))


def test_a_csv_messages_column_is_read_as_json_and_the_system_prompt_goes_first() -> None:
    options = RequestOptions(system_prompt=SYSTEM, defaults={"temperature": 0.0, "max_tokens": 5})
    rows = _read(_csv(ROWS), "csv", options)
    assert all(isinstance(r, ParsedRequest) for r in rows)
    by_id = {r.custom_id: r for r in rows if isinstance(r, ParsedRequest)}
    assert by_id["m-user"].messages == _expected_prompts(SYSTEM)["m-user"]
    assert by_id["m-own-system"].messages == _expected_prompts(SYSTEM)["m-own-system"]
    assert (by_id["p-plain"].prompt, by_id["p-plain"].chat, by_id["p-plain"].system_prompt) == (
        "Bring the bread to the table", None, SYSTEM,
    )  # fmt: skip
    assert by_id["p-plain"].sampling == {"max_tokens": 5, "temperature": 0.0}
    assert by_id["p-hot"].sampling["temperature"] == 1.5  # the row's own field wins


def test_a_csv_with_only_a_messages_column_and_a_cell_that_is_not_json() -> None:
    data = b'messages\n"[{""role"": ""user"", ""content"": ""Hi""}]"\nnot json\n'
    good, bad = _read(data, "csv", RequestOptions())
    assert isinstance(good, ParsedRequest) and good.messages == [{"role": "user", "content": "Hi"}]
    assert isinstance(bad, LineError) and bad.line == 3 and bad.param == "messages" and "JSON list" in bad.message


def test_batch_lines_take_defaults_but_completions_lines_are_never_chat() -> None:
    lines = [
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 3}},
        {"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5, 6]}},
        {"custom_id": "e", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Hi", "max_completion_tokens": 2}},
    ]  # fmt: skip
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    c, d, e = _read(data, "jsonl", RequestOptions(chat=True, system_prompt=SYSTEM, defaults={"max_tokens": 9}))
    assert isinstance(c, ParsedRequest) and isinstance(d, ParsedRequest) and isinstance(e, ParsedRequest)
    assert (c.chat, c.sampling["max_tokens"], d.sampling["max_tokens"], e.sampling["max_tokens"]) == (False, 3, 9, 2)
    token_row = _read(b'{"prompt": [5, 6]}\n', "jsonl", RequestOptions(chat=True))[0]
    assert isinstance(token_row, ParsedRequest) and token_row.chat is False  # token ids are never rendered


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (RequestOptions(defaults={"temperature": 3}), "temperature must be a number"),
        (RequestOptions(defaults={"logprobs": 2}), "unknown sampling default(s) logprobs"),
        (RequestOptions(system_prompt="  "), "system_prompt must be non-empty text"),
        (RequestOptions(defaults={"response_format": {"type": "xml"}}), "response_format"),
    ],
)
def test_bad_options_are_refused_naming_them(options: RequestOptions, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        options.check(InputLimits())


# ---- conveyor run ---------------------------------------------------------------------------


def test_run_renders_prompt_rows_and_messages_through_the_template_once(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    tok = _tokenizer(stack.model)
    path, out = tmp_path / "rows.csv", tmp_path / "out.jsonl"
    path.write_bytes(_csv(ROWS))
    schema = tmp_path / "dish.json"
    schema.write_text(json.dumps(SCHEMA))
    argv = [
        "run", str(path), "--model", stack.model, "-o", str(out), "-q", "--system-prompt", SYSTEM,
        "--max-tokens", "4", "--temperature", "0", "--top-p", "0.9", "--seed", "7", "--stop", "zzz",
        "--stop", "yyy", "--n", "2", "--json-schema", str(schema),
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    results = parse_lines(out.read_text().splitlines())
    _check_rendered(tok, results, SYSTEM)
    for r in results:
        body = r["response"]["body"]
        assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] <= 8
    job = Client(embedded_stack.settings).jobs(limit=1)[0]
    assert job["request_options"] == {
        "chat": "on",  # auto, decided where the model is loaded: this tokenizer has a template
        "system_prompt": SYSTEM,
        "defaults": {
            "max_tokens": 4, "temperature": 0.0, "top_p": 0.9, "seed": 7, "stop": ["zzz", "yyy"], "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "dish", "schema": SCHEMA,
                                                                       "strict": True}},
        },
    }  # fmt: skip
    sampling = _shard_sampling(embedded_stack.settings, job["id"], path.read_bytes(), InputFormat.csv)
    assert sampling["p-plain"] == {
        "max_tokens": 4, "temperature": 0.0, "top_p": 0.9, "seed": 7, "stop": ["zzz", "yyy"], "n": 2,
        "structured_outputs": {"json": SCHEMA},
    }  # fmt: skip
    assert sampling["p-hot"]["temperature"] == 1.5


def test_run_no_chat_sends_the_prompt_as_it_is(embedded_stack, env, tmp_path, capsys) -> None:
    stack = env(embedded_stack)
    tok = _tokenizer(stack.model)
    path, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    path.write_text(json.dumps({"prompt": "Tell the chef about the soup", "echo": True}) + "\n")
    assert main(["run", str(path), "--model", stack.model, "-o", str(out), "-q", "--no-chat", "--max-tokens", "3"]) == 0
    (result,) = parse_lines(out.read_text().splitlines())
    body = result["response"]["body"]
    assert body["choices"][0]["text"].startswith("Tell the chef about the soup")
    assert "<|im_start|>" not in body["choices"][0]["text"][: len("Tell the chef about the soup")]
    assert body["usage"]["prompt_tokens"] == _count(tok, "Tell the chef about the soup", special=True)
    assert Client(embedded_stack.settings).jobs(limit=1)[0]["request_options"]["chat"] == "off"


def test_run_help_shows_the_request_options_and_their_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--chat, --no-chat", "--system-prompt", "--max-tokens", "--temperature", "--top-p", "--seed",
                 "--stop", "--n N", "--response-format", "--json-schema"):  # fmt: skip
        assert flag in text
    assert "default: when the model's tokenizer has a chat template" in text
    assert "(default 256" in text and "(default 1.0)" in text


# ---- the queued path: conveyor submit and a worker ---------------------------------------------


def test_queued_csv_and_parquet_rows_render_once_with_the_system_prompt(
    embedded_stack, env, spawn_worker, tmp_path, capsys
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    stack = env(embedded_stack)
    tok = _tokenizer(stack.model)
    worker = spawn_worker(embedded_stack)
    path = tmp_path / "rows.csv"
    path.write_bytes(_csv(ROWS))
    system_file = tmp_path / "system.txt"
    system_file.write_text(SYSTEM)
    argv = [
        "submit", str(path), "--model", stack.model, "--json", "--system-prompt", f"@{system_file}",
        "--max-tokens", "3", "--temperature", "0", "--top-p", "0.5", "--seed", "11", "--stop", "zzz", "--n", "2",
        "--response-format", "json_object",
    ]  # fmt: skip
    assert main(argv) == 0
    job = json.loads(capsys.readouterr().out)
    assert job["request_options"]["chat"] == "auto" and job["request_options"]["system_prompt"] == SYSTEM
    client = Client(embedded_stack.settings)
    done = client.wait(job["id"], timeout=120, poll=0.2)
    assert done["status"] == "completed" and done["request_counts"]["failed"] == 0, worker.log()[-2000:]
    _check_rendered(tok, parse_lines(client.results(job["id"])), SYSTEM)
    sampling = _shard_sampling(embedded_stack.settings, job["id"], path.read_bytes(), InputFormat.csv)
    assert sampling["m-user"] == {
        "max_tokens": 3, "temperature": 0.0, "top_p": 0.5, "seed": 11, "stop": ["zzz"], "n": 2,
        "structured_outputs": {"json_object": True},
    }  # fmt: skip

    table = pa.table(
        {
            "id": ["pq-m", "pq-p"],
            "prompt": [None, "Bring the bread to the table"],
            "messages": [[{"role": "user", "content": "Serve the tea"}], None],
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    parquet = client.submit(buf.getvalue(), stack.model, input_format="parquet", system_prompt=SYSTEM, max_tokens=2)
    parquet = client.wait(parquet["id"], timeout=120, poll=0.2)
    assert parquet["status"] == "completed" and parquet["request_counts"]["completed"] == 2
    expected = _expected_prompts(SYSTEM)
    for r in parse_lines(client.results(parquet["id"])):
        messages = expected["m-user" if r["custom_id"] == "pq-m" else "p-plain"]
        assert r["response"]["body"]["usage"]["prompt_tokens"] == _count(tok, _rendered(tok, messages))
        assert r["response"]["body"]["usage"]["completion_tokens"] <= 2
        assert r["response"]["body"]["model"] == stack.model  # the name the job was submitted with
    client.close()


# ---- the broker contract ----------------------------------------------------------------------


def test_the_broker_contract_takes_the_options_and_names_a_bad_one(tmp_path, tiny_model) -> None:
    settings = Settings(home=tmp_path, queue_prefix="cv")
    base = {"input_uri": "s3://b/in.csv", "model": "org/model", "idempotency_key": "k"}
    sub = parse_submission([], {**base, "chat": False, "system_prompt": SYSTEM, "temperature": 0.2, "n": 2}, settings)
    assert sub.request_options == RequestOptions(
        chat=False, system_prompt=SYSTEM, defaults={"temperature": 0.2, "n": 2}
    )
    for field, value in (("chat", "yes"), ("temperature", 9), ("stop", [""]), ("system_prompt", 3)):
        with pytest.raises(InvalidSubmission) as caught:
            parse_submission([], {**base, field: value}, settings)
        assert caught.value.param == field and field in str(caught.value)

    settings = settings.model_copy(update={"models": (tiny_model,)})  # the catalog's: brokers take only those
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade_database(url)
    db = create_db_engine(url)
    store = LocalStore(tmp_path / "objects")
    store.put_bytes("inputs/rows.csv", _csv(ROWS))
    msg = {**base, "input_uri": store.uri("inputs/rows.csv"), "model": tiny_model, "system_prompt": SYSTEM,
           "max_tokens": 7, "chat": True}  # fmt: skip
    taken = handle_submission(db, store, settings, [], msg, enqueue_intake=lambda _: None, announce=lambda _: None)
    assert taken["created"] and taken["refused"] is None
    job = ingest_job(db, store, settings, taken["job_id"], enqueue=None)
    assert job["request_options"] == {"chat": "on", "system_prompt": SYSTEM, "defaults": {"max_tokens": 7}}
    shard = store.scoped(object_keys.job_prefix(job["id"]))
    reqs = {r.custom_id: r for r in map(ParsedRequest.from_json, map(json.loads, read_object(
        shard, object_keys.shard_input_key(0)).splitlines()))}  # fmt: skip
    assert reqs["m-user"].messages == _expected_prompts(SYSTEM)["m-user"]
    assert (reqs["p-plain"].chat, reqs["p-plain"].system_prompt, reqs["p-plain"].sampling["max_tokens"]) == (
        True, SYSTEM, 7,
    )  # fmt: skip
    again = handle_submission(
        db, store, settings, [], {**msg, "max_tokens": 8}, enqueue_intake=lambda _: None, announce=lambda _: None
    )
    assert again["refused"] and "request_options" in again["refused"]  # a key names one submission
    db.dispose()


@pytest.mark.parametrize(
    ("flags", "says", "code"),
    [
        (["--temperature", "3"], "temperature must be a number at least 0.0 and at most 2.0, got 3.0", 1),
        (["--n", "0"], "n must be an integer from 1 to 16, got 0", 1),
        (["--json-schema", "/no/such/schema.json"], "cannot read '/no/such/schema.json'", 2),
        (["--system-prompt", "@/no/such/prompt.txt"], "cannot read '/no/such/prompt.txt'", 2),
        (["--response-format", "yaml"], "expected text, json_object or a JSON object", 2),
    ],
)
def test_bad_flags_are_one_line_errors_before_anything_runs(
    embedded_stack, env, tmp_path, capsys, flags, says, code
) -> None:
    stack = env(embedded_stack)
    path = tmp_path / "rows.csv"
    path.write_bytes(_csv(ROWS))
    for command in ("run", "submit"):
        status: int | str | None
        try:
            status = main([command, str(path), "--model", stack.model, *flags])
        except SystemExit as exc:  # argparse's own errors
            status = exc.code
        assert status == code
        assert says in capsys.readouterr().err
    assert Client(embedded_stack.settings).jobs() == []  # no job was created


# ---- a model without a chat template (a base model) -------------------------------------------


@pytest.fixture
def base_model(tiny_model, tmp_path) -> str:
    """The tiny model without its chat template, as base models come."""
    copy = tmp_path / "base-model"
    shutil.copytree(tiny_model, copy)
    (copy / "chat_template.jinja").unlink()
    assert not _tokenizer(str(copy)).chat_template
    return str(copy)


def test_auto_chat_sends_prompts_as_they_are_to_a_model_without_a_template(
    embedded_stack, env, base_model, tmp_path, capsys
) -> None:
    env(embedded_stack)
    tok = _tokenizer(base_model)
    path, out = tmp_path / "rows.csv", tmp_path / "out.jsonl"
    path.write_bytes(_csv(ROWS[:2]))
    assert main(["run", str(path), "--model", base_model, "-o", str(out), "--max-tokens", "2"]) == 0
    assert "chat template for prompt rows: off (auto: the model has no chat template)" in capsys.readouterr().err
    by_id = {r["custom_id"]: r["response"]["body"] for r in parse_lines(out.read_text().splitlines())}
    assert by_id["p-echo"]["choices"][0]["text"].startswith("Tell the chef about the soup")
    for cid, prompt in (("p-echo", "Tell the chef about the soup"), ("p-plain", "Bring the bread to the table")):
        assert by_id[cid]["usage"]["prompt_tokens"] == _count(tok, prompt, special=True)
    assert Client(embedded_stack.settings).jobs(limit=1)[0]["request_options"]["chat"] == "off"

    assert main(["run", str(path), "--model", base_model, "--chat"]) == 1
    err = capsys.readouterr().err
    assert f"conveyor: error: --chat: model {base_model} has no chat template" in err


def test_chat_asked_of_a_model_without_a_template_fails_the_row_saying_why() -> None:
    row = ParsedRequest(1, "a", COMPLETIONS, {"max_tokens": 2}, prompt="Hi", chat=True)
    with pytest.raises(ValueError, match="has no chat template; submit it with --no-chat"):
        engine_prompt(row, chat_template=False)
    auto = ParsedRequest(1, "a", COMPLETIONS, {"max_tokens": 2}, prompt="Hi", chat=None, system_prompt=SYSTEM)
    assert engine_prompt(auto, chat_template=False) == "Hi"
    assert engine_prompt(auto, chat_template=True) == {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    }
    off = ParsedRequest(1, "a", COMPLETIONS, {"max_tokens": 2}, prompt="Hi", chat=False, system_prompt=None)
    assert engine_prompt(off, chat_template=True) == "Hi"


def test_run_a_parquet_messages_column_with_a_response_format(embedded_stack, env, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    stack = env(embedded_stack)
    tok = _tokenizer(stack.model)
    path, out = tmp_path / "rows.parquet", tmp_path / "out.jsonl"
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "Serve the tea"}]], "id": ["m-user"]}), path)
    argv = ["run", str(path), "--model", stack.model, "-o", str(out), "-q", "--system-prompt", SYSTEM,
            "--response-format", '{"type": "json_object"}', "--max-tokens", "3"]  # fmt: skip
    assert main(argv) == 0
    (result,) = parse_lines(out.read_text().splitlines())
    expected = _rendered(tok, _expected_prompts(SYSTEM)["m-user"])
    assert result["response"]["body"]["usage"]["prompt_tokens"] == _count(tok, expected)
    job = Client(embedded_stack.settings).jobs(limit=1)[0]
    assert _shard_sampling(embedded_stack.settings, job["id"], path.read_bytes(), InputFormat.parquet)["m-user"] == {
        "max_tokens": 3, "structured_outputs": {"json_object": True},
    }  # fmt: skip


def test_a_broker_submission_with_options_runs_its_rows_as_chat(pg_redis_s3_stack, spawn_worker) -> None:
    """A plain kombu producer (the README's example) sends the options as message fields; a
    worker over Redis, PostgreSQL and S3 renders the rows with them."""
    import importlib.util

    from kombu import Connection, Queue

    spec = importlib.util.spec_from_file_location("broker_producer", REPO / "examples" / "broker_producer.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    stack = pg_redis_s3_stack
    tok = _tokenizer(stack.model)
    client = Client(stack.settings)
    client.store.put_bytes("inputs/rows.csv", _csv(ROWS))
    worker = spawn_worker(stack)
    worker.wait_ready()
    replies = "chat-rows-replies"
    options = stack.values.get("broker_transport_options") or {}  # the test's own key prefix
    with Connection(stack.values["broker_url"], transport_options=options) as conn:
        Queue(replies, durable=True)(conn.default_channel).declare()
        fields = {
            "input_uri": client.store.uri("inputs/rows.csv"), "model": stack.model, "idempotency_key": "chat-rows",
            "reply_to": replies, "system_prompt": SYSTEM, "chat": True, "max_tokens": 3, "temperature": 0,
            "top_p": 0.8, "seed": 5, "stop": ["zzz"], "n": 2, "response_format": {"type": "json_object"},
        }  # fmt: skip
        example.submit(conn, fields, stack.values["queue_prefix"])
        end = example.wait_for_end(conn, replies, "chat-rows", timeout=120)
    assert end["status"] == "completed", worker.log()[-2000:]
    job = client.status(end["job_id"])
    assert job["request_counts"] == {"total": len(ROWS), "completed": len(ROWS), "failed": 0}
    assert job["request_options"]["chat"] == "on" and job["request_options"]["system_prompt"] == SYSTEM
    _check_rendered(tok, parse_lines(client.results(job["id"])), SYSTEM)
    assert _shard_sampling(stack.settings, job["id"], _csv(ROWS), InputFormat.csv)["p-plain"] == {
        "max_tokens": 3, "temperature": 0.0, "top_p": 0.8, "seed": 5, "stop": ["zzz"], "n": 2,
        "structured_outputs": {"json_object": True},
    }  # fmt: skip
    client.close()
