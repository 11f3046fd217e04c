"""The submission message contract, field by field, and what a worker does with a message
(in process, without a broker): accepted, refused and recorded, or refused and dropped."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types import Batch
from sqlalchemy import select

from conveyor.worker.batchio.records import InputFormat
from conveyor.worker.broker.envelope import body_problem, header_problem
from conveyor.worker.broker.submission_contract import InvalidSubmission, check_reply_to, parse_submission
from conveyor.worker.broker.submissions import handle_submission
from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.keyed_submissions import record_refusal
from conveyor.worker.jobs.lifecycle import get_job
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.models import Job
from conveyor.worker.store.objects.local import LocalStore
from conveyor.worker.store.schema import upgrade_database
from tests.worker.helpers import jsonl, openai_lines


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(home=tmp_path, queue_prefix="cv")


def fields(**overrides: Any) -> dict[str, Any]:
    return {"input_uri": "s3://b/p/in.jsonl", "model": "org/model", "idempotency_key": "k-1", **overrides}


def test_a_full_submission_parses(settings) -> None:
    sub = parse_submission(
        [],
        fields(
            metadata={"team": "a"}, completion_window="7d", priority=3, shard_size=16, input_format="csv",
            reply_to={"exchange": "events", "routing_key": "batches.done", "type": "topic"},
        ),
        settings,
    )  # fmt: skip
    assert (sub.model, sub.idempotency_key, sub.priority, sub.shard_size) == ("org/model", "k-1", 3, 16)
    assert sub.input_format is InputFormat.csv and sub.metadata == {"team": "a"} and sub.completion_window == "7d"
    assert sub.reply_to == {"exchange": "events", "type": "topic", "routing_key": "batches.done"}
    plain = parse_submission((), fields(), settings)
    assert (plain.priority, plain.shard_size, plain.input_format, plain.reply_to) == (0, None, None, None)


@pytest.mark.parametrize(
    ("kwargs", "param", "says"),
    [
        (fields(input_uri=None), "input_uri", "input_uri is required"),
        ({"model": "m", "idempotency_key": "k"}, "input_uri", "input_uri is required"),
        (fields(input_uri=42), "input_uri", "input_uri must be a URI"),
        (fields(input_uri="s3://b/" + "x" * 3000), "input_uri", "1 to 2048"),
        (fields(input_uri="s3://b/a\nb"), "input_uri", "printable"),
        (fields(model=""), "model", "is not one this deployment serves"),
        (fields(model=None), "model", "model is required"),
        (fields(model="no such/dir/here"), "model", "is not one this deployment serves"),
        (fields(model=["m"]), "model", "is not one this deployment serves"),
        (fields(metadata={"k": "a\x00b"}), "metadata.k", "metadata.k must be text without NUL characters"),
        (fields(priority=True), "priority", "priority must be an integer"),
        (fields(priority=-1), "priority", "from 0 to 1000"),
        (fields(shard_size=0), "shard_size", "from 1 to 10000"),
        (fields(shard_size="4"), "shard_size", "shard_size must be an integer"),
        (fields(input_format="xml"), "input_format", "jsonl, csv, parquet"),
        (fields(completion_window="48"), "completion_window", "completion window must be"),
        (fields(metadata=["a"]), "metadata", "'metadata': expected an object, but got list"),
        (fields(metadata={f"k{i}": "v" for i in range(17)}), "metadata", "at most 16"),
        (fields(metadata={"k": "v" * 513}), "metadata", "maximum length 512, but got a string with length 513"),
        (fields(endpoint="/v1/chat/completions"), "endpoint", "unknown field(s) endpoint"),
    ],
)
def test_a_bad_field_is_refused_naming_it(settings, kwargs: dict, param: str, says: str) -> None:
    with pytest.raises(InvalidSubmission) as info:
        parse_submission([], kwargs, settings)
    assert info.value.param == param and says in str(info.value), str(info.value)
    if "idempotency_key" in kwargs:  # still answerable: recorded under its key
        assert info.value.idempotency_key == kwargs["idempotency_key"]


def test_the_key_and_the_reply_target_are_checked_first(settings) -> None:
    with pytest.raises(InvalidSubmission) as info:
        parse_submission([], fields(idempotency_key="", model=None), settings)
    assert info.value.param == "idempotency_key" and info.value.idempotency_key is None
    with pytest.raises(InvalidSubmission) as info:
        parse_submission([], fields(idempotency_key="x" * 257), settings)
    assert "1 to 256" in str(info.value)
    with pytest.raises(InvalidSubmission) as info:
        parse_submission([], fields(reply_to="cv-submit", model=None), settings)
    assert info.value.param == "reply_to" and info.value.idempotency_key == "k-1" and info.value.reply_to is None
    with pytest.raises(InvalidSubmission) as info:
        parse_submission(["in.jsonl"], fields(reply_to="replies"), settings)
    assert "keyword arguments only" in str(info.value)
    assert info.value.idempotency_key == "k-1" and info.value.reply_to == {"queue": "replies"}
    with pytest.raises(InvalidSubmission, match="kwargs must be an object"):
        parse_submission([], ["not", "kwargs"], settings)


def test_reply_targets(settings) -> None:
    assert check_reply_to("replies", "cv") == {"queue": "replies"}
    assert check_reply_to({"queue": "a.b:c-d_e"}, "cv") == {"queue": "a.b:c-d_e"}
    assert check_reply_to({"exchange": "events"}, "cv") == {"exchange": "events", "type": "direct", "routing_key": ""}
    bad = [
        (None, "a queue name or an object"),
        ({}, "'queue' or an 'exchange'"),
        ({"queue": "q", "exchange": "e"}, "takes no exchange"),
        ({"exchange": "e", "routing": "x"}, "unknown fields: routing"),
        ("", "1 to 200"),
        ("a b", "1 to 200"),
        ("q" * 201, "1 to 200"),
        ({"queue": 5}, "1 to 200"),
        ("amq.gen-123", "reserved"),
        ("cv-submit", "reserved"),
        ("cv-Qwen_Qwen3-0_6B", "reserved"),
        ({"exchange": "cv"}, "reserved"),
        ({"exchange": "e", "type": "fanout"}, "direct, topic"),
        ({"exchange": "e", "routing_key": "a b"}, "routing_key"),
        ({"exchange": "e", "routing_key": "k" * 256}, "routing_key"),
    ]
    for value, says in bad:
        with pytest.raises(ValueError) as info:
            check_reply_to(value, "cv")
        assert says in str(info.value), (value, str(info.value))
    assert check_reply_to("cvx-replies", "cv") == {"queue": "cvx-replies"}  # only the prefix's own names


def test_malformed_envelopes_are_named() -> None:
    good = {"id": "t-1", "task": "conveyor.submit_job"}
    assert header_problem(good) is None and body_problem([[], {}, None]) is None
    assert header_problem({"task": "x"}) == "its headers have no 'id' (the task id, a string)"
    assert header_problem({**good, "id": ["t"]}) is not None
    assert (
        header_problem({**good, "timelimit": [1]}) is not None and header_problem({**good, "timelimit": None}) is None
    )
    assert header_problem({**good, "retries": "1"}) is not None
    assert header_problem("headers") is not None
    bodies: list[Any] = ["text", [[], {}], [{}, {}, {}], [[], [], {}], [[], {}, []]]
    for body in bodies:
        assert body_problem(body) is not None, body


def test_a_refusal_is_recorded_once_under_its_key(db_engine, settings) -> None:
    first, created = record_refusal(
        db_engine, settings, idempotency_key="k", code="invalid_submission", message="model is required",
        param="model", model=None, metadata={"bad": 1}, notify={"queue": "q"},
    )  # fmt: skip
    assert created and first["status"] == "failed" and first["metadata"] is None
    Batch.model_validate(first, strict=True)  # still OpenAI's batch object
    assert first["errors"]["data"] == [
        {"code": "invalid_submission", "message": "model is required", "param": "model", "line": None}
    ]
    again, created_again = record_refusal(
        db_engine, settings, idempotency_key="k", code="invalid_submission", message="other", model="m"
    )
    assert (again["id"], created_again) == (first["id"], False)


@pytest.fixture
def local(tmp_path, settings):
    """A database and a local store, as a worker has them (no broker: calls are recorded)."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade_database(url)
    db = create_db_engine(url)
    yield db, LocalStore(tmp_path / "objects")
    db.dispose()


def test_a_worker_takes_a_message_once_per_key(local, settings, tiny_model) -> None:
    db, store = local
    settings = settings.model_copy(update={"models": (tiny_model,)})  # the catalog's
    store.put_bytes("inputs/rows.txt", b"prompt,max_tokens\nHello there,4\n")  # CSV, whatever its name
    intakes: list[str] = []
    announced: list[str] = []

    def take(kwargs: dict, args: Any = ()) -> dict:
        return handle_submission(
            db, store, settings, args, kwargs, enqueue_intake=intakes.append, announce=announced.append
        )

    msg = {"input_uri": store.uri("inputs/rows.txt"), "model": tiny_model, "idempotency_key": "csv-1"}
    first = take(msg)
    assert first["created"] and first["status"] == "validating" and first["refused"] is None
    assert get_job(db, first["job_id"])["input_uri"] == store.uri("inputs/rows.txt")
    again = take(msg)  # a redelivery, or the producer's retry
    assert (again["job_id"], again["created"]) == (first["job_id"], False)
    assert intakes == [first["job_id"], first["job_id"]]  # the intake is sent again: it is idempotent
    assert announced == []

    outside = take({**msg, "input_uri": "file:///etc/passwd", "idempotency_key": "evil", "reply_to": "r"})
    assert outside["status"] == "failed" and "not an object in this store" in outside["refused"]
    assert announced == [outside["job_id"]] and len(intakes) == 2
    dropped = take({**msg, "idempotency_key": None})
    assert dropped == {"job_id": None, "status": None, "created": False, "refused": "idempotency_key is required"}


def test_a_key_reused_for_another_submission_is_refused_and_changes_nothing(local, settings, tiny_model) -> None:
    db, store = local
    settings = settings.model_copy(update={"models": (tiny_model,)})  # the catalog's
    store.put_bytes("inputs/a.jsonl", jsonl(openai_lines(1)))
    store.put_bytes("inputs/b.jsonl", jsonl(openai_lines(2)))
    intakes: list[str] = []

    def take(kwargs: dict) -> dict:
        return handle_submission(
            db, store, settings, [], kwargs, enqueue_intake=intakes.append, announce=lambda _: None
        )

    msg = {"input_uri": store.uri("inputs/a.jsonl"), "model": tiny_model, "idempotency_key": "k-1",
           "metadata": {"team": "a"}, "priority": 2}  # fmt: skip
    first = take(msg)
    assert first["created"] and first["refused"] is None
    assert take(msg)["refused"] is None  # the same message again is a redelivery, not a reuse
    for change, named in (
        ({"input_uri": store.uri("inputs/b.jsonl")}, "input_uri"),
        ({"metadata": {"team": "b"}}, "metadata"),
        ({"priority": 3}, "priority"),
        ({"completion_window": "2h"}, "completion_window"),
    ):
        reused = take({**msg, **change})
        assert reused["job_id"] == first["job_id"] and not reused["created"]
        assert reused["refused"] is not None and f"different {named}" in reused["refused"], reused
        assert "new key" in reused["refused"]
    assert intakes == [first["job_id"]] * 2  # refusals send nothing
    job = get_job(db, first["job_id"])
    assert (job["input_uri"], job["metadata"], job["priority"]) == (store.uri("inputs/a.jsonl"), {"team": "a"}, 2)


def test_the_input_format_comes_from_the_object(local, settings, tiny_model) -> None:
    db, store = local
    settings = settings.model_copy(update={"models": (tiny_model,)})  # the catalog's
    store.put_bytes("in/batch.csv", jsonl(openai_lines(1)))  # JSONL despite its name
    store.put_bytes("in/table", b"PAR1" + b"\0" * 16)
    for key, expected in (("in/batch.csv", "jsonl"), ("in/table", "parquet")):
        out = handle_submission(
            db, store, settings, [], {"input_uri": store.uri(key), "model": tiny_model, "idempotency_key": key},
            enqueue_intake=lambda _: None, announce=lambda _: None,
        )  # fmt: skip
        with db.connect() as conn:
            fmt = conn.execute(select(Job.input_format).where(Job.id == out["job_id"])).scalar_one()
        assert fmt == expected, key


def test_a_producer_cannot_take_an_http_idempotency_key(settings) -> None:
    """The HTTP API stores ``api:<owner>:<key>``; a broker key in that namespace is refused and,
    having no valid key, recorded under none (the tenant's key stays free)."""
    with pytest.raises(InvalidSubmission, match="must not start with 'api:'") as info:
        parse_submission([], fields(idempotency_key="api:key_1:nightly"), settings)
    assert info.value.param == "idempotency_key" and info.value.idempotency_key is None


def test_only_models_the_deployment_serves_are_taken_and_paths_tell_nothing(local, settings, tiny_model) -> None:
    db, store = local
    store.put_bytes("inputs/a.jsonl", jsonl(openai_lines(1)))
    intakes: list[str] = []
    answers = {}
    for key, model in {"dir": "/etc", "missing": "/no/such/dir", "hub": "org/never-served", "bad": "a\x00b"}.items():
        msg = {"input_uri": store.uri("inputs/a.jsonl"), "model": model, "idempotency_key": key}
        answers[key] = handle_submission(
            db, store, settings, [], msg, enqueue_intake=intakes.append, announce=lambda job_id: None
        )
    for key, model in {"dir": "/etc", "missing": "/no/such/dir", "hub": "org/never-served"}.items():
        assert answers[key]["status"] == "failed"
        assert answers[key]["refused"] == (
            f"model {model!r} is not one this deployment serves "
            "(declared in CONVEYOR_MODELS, or served by a worker under that name)"
        )
    assert answers["bad"]["status"] == "failed"
    assert answers["bad"]["refused"].startswith("model must be text without NUL characters or lone surrogates")
    assert intakes == []  # no intake, so no shard and no queue for any of those names
    with db.connect() as conn:
        assert conn.execute(select(Job.status).where(Job.status != "failed")).all() == []
    served = settings.model_copy(update={"models": (tiny_model,)})
    msg = {"input_uri": store.uri("inputs/a.jsonl"), "model": tiny_model, "idempotency_key": "ok"}
    ok = handle_submission(db, store, served, [], msg, enqueue_intake=intakes.append, announce=lambda job_id: None)
    assert ok["status"] == "validating" and intakes == [ok["job_id"]]


def test_a_refusal_naming_a_nul_is_still_recorded(db_engine, settings) -> None:
    """PostgreSQL refuses NUL in text and JSONB: a refused submission whose model, message or
    metadata holds one is still recorded (and so announced), not lost."""
    job, created = record_refusal(
        db_engine, settings, idempotency_key="nul", code="invalid_submission",
        message="unknown field(s) a\x00b", param="a\x00b", model="m\x00", metadata={"k": "v\x00"},
    )  # fmt: skip
    assert created and job["status"] == "failed" and job["metadata"] is None
    assert job["errors"]["data"][0]["message"] == "unknown field(s) a\ufffdb"


def test_reply_to_stays_within_the_operators_prefix(tmp_path) -> None:
    assert check_reply_to("billing-jobs", "cv") == {"queue": "billing-jobs"}  # no prefix set: any foreign name
    assert check_reply_to("replies.nightly", "cv", "replies.") == {"queue": "replies.nightly"}
    for value in ("billing-jobs", {"exchange": "billing"}, "replies"):
        with pytest.raises(ValueError, match=r"must start with 'replies\.' \(CONVEYOR_REPLY_TO_PREFIX\)"):
            check_reply_to(value, "cv", "replies.")
    settings = Settings(home=tmp_path, queue_prefix="cv", reply_to_prefix="replies.")
    with pytest.raises(InvalidSubmission) as info:
        parse_submission([], fields(reply_to="billing-jobs"), settings)
    assert info.value.param == "reply_to" and info.value.reply_to is None  # nothing is published there


def test_delayed_chained_and_oversized_messages_are_named() -> None:
    """What the worker's checked request and the API server's submission consumer refuse."""
    from conveyor.worker.broker.envelope import size_problem

    headers = {"id": "t", "task": "conveyor.submit_job"}
    assert header_problem(headers) is None
    assert "'eta' header" in (header_problem({**headers, "eta": "2030-01-01T00:00:00"}) or "")
    assert "'expires' header" in (header_problem({**headers, "expires": "2030-01-01T00:00:00"}) or "")
    assert body_problem([[], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]) is None
    chained = body_problem([[], {}, {"callbacks": [{"task": "celery.accumulate"}], "chain": [{"task": "x"}]}])
    assert chained is not None and "callbacks, chain" in chained
    assert size_problem(b"x" * 100, 100) is None
    assert "101 bytes, over the limit of 100" in (size_problem(b"x" * 101, 100) or "")
