"""Quotas per owner at the HTTP API, driven by the official ``openai`` SDK against ``conveyor
serve``'s app on PostgreSQL, Redis and S3 (moto): past a quota the answer is 429, OpenAI's
rate-limit shape naming the limit, nothing is kept, and another owner is unaffected.

No worker runs: a declared model's batches stay ``validating``, which is "queued" for the
quotas (work counts from a batch's creation until it ends), or ``in_progress`` once the test
runs their intake itself (``ingest_job``, what a worker's intake lane runs) with no worker to
run their shards. Two apps on one database stand for two API replicas."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import openai
import pytest

from conveyor.worker.batchio.batch_scan import BatchScanner
from conveyor.worker.jobs.submission import ingest_job
from conveyor.worker.store.database import create_db_engine
from conveyor.worker.store.objects.factory import open_store_from_settings
from tests.worker.helpers import jsonl, openai_lines

CHAT: Final = "/v1/chat/completions"
MODEL = "tiny-chat"


def lines(count: int, **body: Any) -> bytes:
    rows = openai_lines(count)
    for row in rows:
        row["body"]["model"] = MODEL
        row["body"].pop("max_tokens")
        row["body"].update(body)
    return jsonl(rows)


def upload(client: openai.OpenAI, data: bytes) -> str:
    return client.files.create(file=("in.jsonl", data), purpose="batch").id


def create(client: openai.OpenAI, file_id: str) -> str:
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id


def rate_limited(call: Any, limit: str) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as caught:
        call()
    err = caught.value
    assert err.status_code == 429
    assert err.code == "rate_limit_exceeded" and err.param == limit, err.body
    assert f"CONVEYOR_QUOTA_{limit.upper()}" in err.message and f"({limit})" in err.message
    return err


def run_intake(settings: Any, batch_id: str) -> str:
    """Ingest the batch as a worker's intake lane would (its shards then wait for a worker)."""
    db = create_db_engine(settings.database)
    try:
        return ingest_job(db, open_store_from_settings(settings), settings, batch_id, enqueue=None)["status"]
    finally:
        db.dispose()


@pytest.fixture
def two_owners(pg_redis_s3_stack, serve):
    def start(**quotas: Any) -> tuple[openai.OpenAI, openai.OpenAI]:
        server = serve(pg_redis_s3_stack, models=[MODEL], default_max_tokens=100, **quotas)
        return server.client(server.new_key("a")), server.client(server.new_key("b"))

    return start


def test_active_batches_quota_answers_429_and_spares_another_owner(two_owners) -> None:
    a, b = two_owners(quota_active_batches=2)
    file_a = upload(a, lines(1))
    first = create(a, file_a)
    create(a, file_a)
    err = rate_limited(lambda: create(a, file_a), "active_batches")
    assert "limit 2, used 2, requested 1" in err.message
    assert len(a.batches.list().data) == 2  # the refused batch was not recorded

    create(b, upload(b, lines(1)))  # another owner's first batch: unaffected
    create(b, upload(b, lines(1)))

    assert a.batches.cancel(first).status in ("cancelling", "cancelled")
    wait_ended(a, first)
    create(a, file_a)  # a batch that ended no longer counts


def wait_ended(client: openai.OpenAI, batch_id: str) -> None:
    import time

    deadline = time.monotonic() + 30
    while client.batches.retrieve(batch_id).status != "cancelled":
        assert time.monotonic() < deadline, "the cancelled batch never ended"
        time.sleep(0.1)


def test_queued_tokens_count_n_times_max_tokens_per_line(two_owners) -> None:
    a, b = two_owners(quota_queued_tokens=1000)
    big = upload(a, lines(2, n=2, max_tokens=200))  # 2 x 2 x 200 = 800
    create(a, big)
    err = rate_limited(lambda: create(a, upload(a, lines(1, max_tokens=201))), "queued_tokens")
    assert "limit 1000, used 800, requested 201" in err.message
    # A line naming no max_tokens is charged the default (100 here), per sample.
    err = rate_limited(lambda: create(a, upload(a, lines(1, n=3))), "queued_tokens")
    assert "used 800, requested 300" in err.message
    create(a, upload(a, lines(2)))  # 200 more: exactly the quota
    rate_limited(lambda: create(a, upload(a, lines(1, max_tokens=1))), "queued_tokens")
    create(b, upload(b, lines(2, n=2, max_tokens=250)))  # 1000 of b's own


def test_queued_lines_quota(two_owners) -> None:
    a, b = two_owners(quota_queued_lines=5)
    create(a, upload(a, lines(4)))
    err = rate_limited(lambda: create(a, upload(a, lines(2))), "queued_lines")
    assert "limit 5, used 4, requested 2" in err.message
    create(a, upload(a, lines(1)))
    create(b, upload(b, lines(5)))


def test_deleting_a_running_batchs_file_keeps_its_charge(pg_redis_s3_stack, serve) -> None:
    server = serve(pg_redis_s3_stack, models=[MODEL], default_max_tokens=100, quota_queued_tokens=1500)
    a = server.client(server.new_key("a"))
    data = lines(2, max_tokens=500)  # 1000 tokens, where the default would charge 200
    first_file = upload(a, data)
    first = create(a, first_file)
    assert run_intake(server.settings, first) == "in_progress"
    rate_limited(lambda: create(a, upload(a, data)), "queued_tokens")
    a.files.delete(first_file)  # its batch has read it: the file may go, its charge stays
    err = rate_limited(lambda: create(a, upload(a, data)), "queued_tokens")
    assert "limit 1500, used 1000, requested 1000" in err.message
    a.batches.cancel(first)
    wait_ended(a, first)
    create(a, upload(a, data))  # a batch that ended gives its charge back


OWNERS, ATTEMPTS = 2, 20


def slow_inserts(settings: Any, *tables: str) -> None:
    """Each insert into ``tables`` takes 0.2 s more (a PostgreSQL trigger, as a busy database
    would): a check that did not hold the owner's turn until its insert committed lets the
    other replica's check read the count from before, every time, not once in a while."""
    db = create_db_engine(settings.database)
    try:
        with db.begin() as conn:
            conn.exec_driver_sql(
                "CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN PERFORM pg_sleep(0.2); RETURN NEW; END $$"
            )
            for table in tables:
                conn.exec_driver_sql(
                    f"CREATE TRIGGER slow_{table} BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION slow_insert()"
                )
    finally:
        db.dispose()


def race(replicas: list[Any], attempt: Any, prepare: Any = None) -> dict[int, list[str]]:
    """``attempt(client, owner)`` ATTEMPTS times for each of OWNERS owners at once, every
    owner's attempts split across the replicas (after ``prepare(client, owner)``, one at a
    time); each owner's answers."""
    keys = [replicas[0].new_key(f"owner-{n}") for n in range(OWNERS)]
    clients = [[r.client(key) for r in replicas] for key in keys]
    for n in range(OWNERS):
        if prepare is not None:
            prepare(clients[n][0], n)
    jobs = [(n, i) for i in range(ATTEMPTS) for n in range(OWNERS)]
    with ThreadPoolExecutor(2 * ATTEMPTS) as pool:
        answers = list(pool.map(lambda job: attempt(clients[job[0]][job[1] % len(replicas)], job[0]), jobs))
    by_owner: dict[int, list[str]] = {n: [] for n in range(OWNERS)}
    for (n, _), answer in zip(jobs, answers, strict=True):
        by_owner[n].append(answer)
    return by_owner


def test_replicas_never_accept_more_batches_than_the_quota_together(pg_redis_s3_stack, serve) -> None:
    stack = pg_redis_s3_stack.with_values(models=[MODEL], quota_active_batches=3)
    replicas = [serve(stack), serve(stack)]  # two apps, each with its own process-level locks
    slow_inserts(stack.settings, "jobs")
    files: dict[int, str] = {}

    def prepare(client: openai.OpenAI, owner: int) -> None:
        files[owner] = upload(client, lines(1))

    def attempt(client: openai.OpenAI, owner: int) -> str:
        try:
            create(client, files[owner])
            return "accepted"
        except openai.RateLimitError as err:
            assert err.param == "active_batches", err.body
            return "429"

    for owner, answers in race(replicas, attempt, prepare).items():
        assert answers.count("accepted") == 3 and answers.count("429") == ATTEMPTS - 3, (owner, answers)


def test_replicas_never_keep_more_files_than_the_quota_together(pg_redis_s3_stack, serve) -> None:
    stack = pg_redis_s3_stack.with_values(
        quota_files=3, max_concurrent_uploads_per_key=ATTEMPTS, max_concurrent_uploads=OWNERS * ATTEMPTS
    )
    replicas = [serve(stack), serve(stack)]
    slow_inserts(stack.settings, "files")

    def attempt(client: openai.OpenAI, owner: int) -> str:
        try:
            upload(client, lines(1))
            return "kept"
        except openai.RateLimitError as err:
            assert err.param == "files", err.body
            return "429"

    for owner, answers in race(replicas, attempt).items():
        assert answers.count("kept") == 3, (owner, answers)


def test_files_and_stored_bytes_quotas_keep_nothing_past_them(two_owners) -> None:
    a, b = two_owners(quota_files=3, quota_stored_bytes=4000)
    kept = [upload(a, lines(1)), upload(a, b"x" * 1500)]
    before = {f.id for f in a.files.list()}
    err = rate_limited(lambda: upload(a, b"y" * 2600), "stored_bytes")  # refused once its size is known
    assert "requested 2600" in err.message
    assert {f.id for f in a.files.list()} == before == set(kept)
    upload(a, b"z" * 100)
    rate_limited(lambda: upload(a, b"w"), "files")
    upload(b, b"v" * 3900)  # another owner's store: unaffected
    a.files.delete(kept[1])
    upload(a, b"w")  # a deleted file frees its place


def test_declared_length_over_the_bytes_quota_is_refused_before_the_body() -> None:
    # The declared length less the multipart envelope is a lower bound of the file's size.
    from starlette.requests import Request

    from conveyor.worker.api.quota_checks import declared_length
    from conveyor.worker.api.uploads import MULTIPART_OVERHEAD

    def request(length: str) -> Request:
        return Request({"type": "http", "headers": [(b"content-length", length.encode())]})

    assert declared_length(request(str(MULTIPART_OVERHEAD + 5000))) == 5000
    assert declared_length(request("10")) == 0
    assert declared_length(request("nope")) == 0


def test_scanner_counts_requested_tokens_whatever_the_chunking() -> None:
    data = lines(3, n=2, max_tokens=7) + lines(2) + lines(1, max_completion_tokens=5) + b'{"body": {"n": true}}\n'
    data += lines(1, max_output_tokens=4)  # a /v1/responses line's limit
    for size in (1, 7, len(data)):
        scanner = BatchScanner(1 << 20)
        for start in range(0, len(data), size):
            scanner.feed(data[start : start + size])
        scan = scanner.finish()
        assert (scan.requested_tokens, scan.default_token_samples) == (3 * 2 * 7 + 5 + 4, 3)
        assert scan.output_tokens(10) == 51 + 30
