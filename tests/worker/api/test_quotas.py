"""Quotas per owner at the HTTP API, driven by the official ``openai`` SDK against ``conveyor
serve``'s app on PostgreSQL, Redis and S3 (moto): past a quota the answer is 429, OpenAI's
rate-limit shape naming the limit, nothing is kept, and another owner is unaffected.

No worker runs: a declared model's batches stay ``validating``, which is "queued" for the
quotas (work counts from a batch's creation until it ends)."""

from __future__ import annotations

from typing import Any, Final

import openai
import pytest

from conveyor.worker.batchio.batch_scan import BatchScanner
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
