"""The layers under the HTTP API: what an upload learns while it streams (``BatchScanner``),
Files objects by owner (``conveyor.worker.jobs.files``), API keys (``conveyor.worker.store.api_keys``), served
model names; and that an upload streams through the server in bounded memory."""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Iterator

import httpx2 as httpx
import pytest
from sqlalchemy import insert, select, text, update

from conveyor.worker.batchio.batch_scan import MAX_MODELS, BatchScanner
from conveyor.worker.jobs.files import (
    ExpiredFiles,
    FileExpired,
    FileInUse,
    FileNotFound,
    FileTooLarge,
    FileUpload,
    OutputFile,
    delete_expired_files,
    delete_file,
    get_file,
    list_files,
    record_output_files,
)
from conveyor.worker.jobs.model_names import InvalidModel, check_served_name
from conveyor.worker.jobs.unfinished_reads import NoUnfinished, open_unfinished
from conveyor.worker.store.api_keys import (
    KEY_PREFIX,
    KeyNameError,
    KeyNotFound,
    KeyVerifier,
    active_key_count,
    create_key,
    find_key,
    list_keys,
    revoke_key,
)
from conveyor.worker.store.items import ItemRecord, record_finished_items
from conveyor.worker.store.models import ApiKey, Item, ItemStatus, Job, JobStatus, StoredFile
from conveyor.worker.store.objects.local import LocalStore
from tests.worker.api_server import ApiServer
from tests.worker.helpers import jsonl, openai_lines

MiB = 1 << 20


def _line(model: str | None = "m", url: str = "/v1/chat/completions", i: int = 0) -> bytes:
    body: dict = {"messages": [{"role": "user", "content": f"hi {i}"}]}
    if model is not None:
        body["model"] = model
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}).encode()


def scan(data: bytes, chunk: int, max_line_bytes: int = 1 << 20):
    scanner = BatchScanner(max_line_bytes)
    for start in range(0, len(data), chunk):
        scanner.feed(data[start : start + chunk])
    return scanner.finish()


def test_the_scanner_learns_the_same_whatever_the_chunks() -> None:
    data = b"\n".join(
        [_line("a", i=1), b"", b"  ", b"{not json", _line("b", i=2), b"[1, 2]", b"\xff\xfe", _line(None, i=3)]
    )
    data += b"\r\n" + _line("a", url="/v1/completions", i=4)  # a CRLF line, and a last line with no newline
    results = {chunk: scan(data, chunk).as_meta() for chunk in (1, 2, 3, 7, 64, 1 << 20)}
    first = results[1]
    assert all(r == first for r in results.values()), results
    assert first["lines"] == 7  # blank lines are not requests
    assert first["models"] == ["a", "b"] and first["urls"] == ["/v1/chat/completions", "/v1/completions"]
    assert (first["not_json"], first["first_not_json_line"], first["without_model"]) == (3, 4, 1)


def test_the_scanner_skips_long_lines_without_holding_them_and_caps_what_it_keeps() -> None:
    long_line = b'{"body": {"model": "' + b"x" * 5000 + b'"}}'
    data = b"\n".join([_line("a"), long_line, _line("b")]) + b"\n"
    for chunk in (1, 100, 1 << 20):
        scanner = BatchScanner(max_line_bytes=1000)
        for start in range(0, len(data), chunk):
            scanner.feed(data[start : start + chunk])
            assert len(scanner._splitter._partial) <= 1002  # never more than one line's worth (and "\r\n")
        result = scanner.finish()
        assert (result.lines, result.too_long, result.models) == (3, 1, ["a", "b"])
    many = b"\n".join(_line(f"m{i}", i=i) for i in range(MAX_MODELS + 3))
    result = scan(many, 4096)
    assert len(result.models) == MAX_MODELS and result.more_models


def test_an_upload_is_whole_or_nothing_and_scoped_by_owner(tmp_path, db_engine) -> None:
    store = LocalStore(tmp_path / "objects")
    upload = FileUpload(store, max_bytes=100, scan_line_bytes=1000)
    upload.write(b"x" * 60)
    with pytest.raises(FileTooLarge):
        upload.write(b"x" * 41)
    assert list(store.list()) == []  # aborted: nothing stored, no row

    rows = jsonl([_line("m", i=i) for i in range(3)])
    upload = FileUpload(store, max_bytes=1 * MiB, scan_line_bytes=1000)
    for start in range(0, len(rows), 10):
        upload.write(rows[start : start + 10])
    obj = upload.commit(db_engine, owner="key_a", purpose="batch", filename="../../etc/passwd")
    assert obj["bytes"] == len(rows) and obj["filename"] == "../../etc/passwd"
    assert list(store.list()) == [f"files/{obj['id']}/content"]  # the name never became a key
    with db_engine.connect() as conn:
        meta = conn.execute(select(StoredFile.meta).where(StoredFile.id == obj["id"])).scalar_one()
    assert meta["batch"]["lines"] == 3 and meta["batch"]["models"] == ["m"]
    assert get_file(db_engine, obj["id"], "key_a") == obj
    for other in ("key_b", None):
        with pytest.raises(FileNotFound):
            get_file(db_engine, obj["id"], other)
        with pytest.raises(FileNotFound):
            delete_file(db_engine, store, obj["id"], other)
        assert list_files(db_engine, other)["data"] == []

    # A batch that has not read it yet holds on to it.
    with db_engine.begin() as conn:
        conn.execute(
            insert(Job).values(
                id="batch_" + "a" * 32, status=JobStatus.validating, model="m", shard_size=4,
                input_file_id=obj["id"], owner="key_a", completion_window="24h", created_at=1.0, updated_at=1.0,
            )
        )  # fmt: skip
    with pytest.raises(FileInUse):
        delete_file(db_engine, store, obj["id"], "key_a")
    with db_engine.begin() as conn:
        conn.execute(update(Job).values(status=JobStatus.in_progress))
    assert delete_file(db_engine, store, obj["id"], "key_a")["deleted"]
    assert list(store.list()) == []


def test_file_pages_and_expiry(tmp_path, db_engine) -> None:
    store = LocalStore(tmp_path / "objects")
    ids = []
    for i in range(5):
        upload = FileUpload(store, max_bytes=MiB)
        upload.write(b"data %d\n" % i)
        ids.append(upload.commit(db_engine, owner=None, purpose="user_data", filename=f"{i}.txt")["id"])
    with db_engine.begin() as conn:  # same creation time for some: the id breaks the tie
        conn.execute(update(StoredFile).where(StoredFile.id.in_(ids[1:3])).values(created_at=1000.0))
        conn.execute(update(StoredFile).where(StoredFile.id.not_in(ids[1:3])).values(created_at=2000.0))
    order = [r["id"] for r in list_files(db_engine, None, limit=10)["data"]]

    def walk(**kw) -> list[str]:
        seen, after = [], None
        while True:
            page = list_files(db_engine, None, limit=2, after=after, **kw)
            seen += [f["id"] for f in page["data"]]
            if not page["has_more"]:
                return seen
            after = page["last_id"]

    assert walk() == order and walk(order="asc") == order[::-1] and len(order) == 5
    assert list_files(db_engine, None, purpose="batch")["data"] == []
    with pytest.raises(ValueError, match="limit"):
        list_files(db_engine, None, limit=10_001)

    with db_engine.begin() as conn:
        conn.execute(update(StoredFile).where(StoredFile.id == ids[0]).values(expires_at=time.time() - 1))
    with pytest.raises(FileNotFound, match=f"File {ids[0]} expired at"):
        get_file(db_engine, ids[0], None)
    assert ids[0] not in [f["id"] for f in list_files(db_engine, None)["data"]]
    assert delete_expired_files(db_engine, store) == ExpiredFiles(files=1, bytes=len(b"data 0\n"))
    assert len(list(store.list())) == 4


def test_keys_are_stored_as_hashes_and_revoked_at_once(db_engine) -> None:
    info, key = create_key(db_engine, "alice")
    assert key.startswith(KEY_PREFIX) and len(key) > 40 and info.active
    with db_engine.connect() as conn:
        dump = json.dumps([list(r) for r in conn.execute(select(ApiKey.__table__))], default=str)
    assert key not in dump and key[len(KEY_PREFIX) :] not in dump  # only its hash is kept
    assert find_key(db_engine, key) == info.id
    for wrong in ("", key + "x", key.upper(), "sk-" + "x" * 10_000):
        assert find_key(db_engine, wrong) is None
    with pytest.raises(KeyNameError, match="exists already"):
        create_key(db_engine, "alice")
    for bad in ("", "a b", "-x", "x" * 129, "a/b"):
        with pytest.raises(KeyNameError):
            create_key(db_engine, bad)
    _, bob_key = create_key(db_engine, "bob")
    assert active_key_count(db_engine) == 2
    assert revoke_key(db_engine, "alice").revoked_at is not None
    assert find_key(db_engine, key) is None and find_key(db_engine, bob_key) is not None
    revoked_at = revoke_key(db_engine, "alice").revoked_at  # again: unchanged
    assert [k.revoked_at for k in list_keys(db_engine) if k.name == "alice"] == [revoked_at]
    with pytest.raises(KeyNotFound):
        revoke_key(db_engine, "nobody")
    assert active_key_count(db_engine) == 1


def test_key_use_is_recorded_at_most_once_per_interval(db_engine) -> None:
    _, key = create_key(db_engine, "busy")
    verifier = KeyVerifier(db_engine, touch_seconds=3600)
    statements: list[str] = []
    from sqlalchemy import event

    def count(_conn, _cursor, statement, *_args) -> None:
        statements.append(statement)

    event.listen(db_engine, "before_cursor_execute", count)
    try:
        for _ in range(50):
            assert verifier.verify(key) is not None
    finally:
        event.remove(db_engine, "before_cursor_execute", count)
    assert sum(s.lstrip().upper().startswith("UPDATE") for s in statements) == 1
    with db_engine.connect() as conn:
        assert conn.execute(text("SELECT last_used_at FROM api_keys")).scalar_one() is not None


def test_a_verified_key_is_taken_without_the_database_for_a_moment(db_engine) -> None:
    _, key = create_key(db_engine, "quick")
    verifier = KeyVerifier(db_engine, cache_seconds=2.0)  # room for a slow database write below
    assert verifier.cached(key) is None  # never verified here
    key_id = verifier.verify(key)
    assert key_id is not None and verifier.cached(key) == key_id
    assert verifier.cached(key + "x") is None and verifier.cached("x" * 10_000) is None
    revoke_key(db_engine, "quick")
    assert verifier.cached(key) == key_id  # for at most cache_seconds
    time.sleep(2.1)
    assert verifier.cached(key) is None and verifier.verify(key) is None


def test_served_model_names_are_names_not_paths() -> None:
    for good in ("tiny-chat", "org/llama-3-8b", "Qwen3.0"):
        assert check_served_name(good) == good
    for bad in ("/abs/path", "../up", "a/b/c", "", "sp ace", "x" * 300, ".hidden"):
        with pytest.raises(InvalidModel):
            check_served_name(bad)


def test_an_upload_streams_through_the_server_in_bounded_memory(embedded_stack) -> None:
    server = ApiServer(embedded_stack.settings).start()
    try:
        key = server.new_key("big")
        line = jsonl([{**openai_lines(1)[0], "body": {**openai_lines(1)[0]["body"], "model": "m"}}])
        size = 24 * MiB
        boundary = "bounded-memory"

        def body() -> Iterator[bytes]:  # made on the fly: the test holds no copy either
            yield f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode()
            yield f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="b.jsonl"\r\n\r\n'.encode()
            block = line * (65536 // len(line))
            sent = 0
            while sent + len(block) <= size:
                yield block
                sent += len(block)
            yield f"\r\n--{boundary}--\r\n".encode()

        headers = {"Authorization": f"Bearer {key}", "Content-Type": f"multipart/form-data; boundary={boundary}"}
        tracemalloc.start()
        try:
            answer = httpx.post(f"{server.url}/v1/files", content=body(), headers=headers, timeout=120)
            _current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert answer.status_code == 200, answer.text
        assert answer.json()["bytes"] > size - MiB
        # Python allocations of the whole process (server and client) during a 24 MiB upload.
        assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB"
    finally:
        server.stop()


def test_a_batchs_expired_output_files_take_its_answers_with_them(tmp_path, db_engine) -> None:
    store = LocalStore(tmp_path / "objects")
    job_id, other_id = "batch_" + "b" * 32, "batch_" + "c" * 32
    with db_engine.begin() as conn:
        for jid in (job_id, other_id):
            conn.execute(
                insert(Job).values(
                    id=jid, status=JobStatus.cancelled, model="m", shard_size=4, owner="key_a",
                    input_file_id="file-" + "0" * 32, completion_window="24h", created_at=1.0, updated_at=1.0,
                )
            )  # fmt: skip
    record_finished_items(
        db_engine,
        [
            ItemRecord(jid, f"r{i}", 0, i, ItemStatus.succeeded, response={"i": i})
            for jid in (job_id, other_id)
            for i in (1, 2)
        ],
    )
    outputs: dict[str, dict[str, str]] = {}
    for jid in (job_id, other_id):
        job_store = store.scoped(f"jobs/{jid}")
        job_store.put_bytes("results.jsonl", b'{"i": 1}\n{"i": 2}\n')
        job_store.put_bytes("errors.jsonl", b'{"e": 3}\n')
        results = OutputFile(job_store.uri("results.jsonl"), 18, 2)
        errors = OutputFile(job_store.uri("errors.jsonl"), 9, 1)
        with db_engine.begin() as conn:
            made = record_output_files(conn, jid, "key_a", results, errors, expires_after=3600)
        outputs[jid] = {column: file_id for column, file_id in made.items() if file_id is not None}
    # A row whose uri points outside its own folder loses its row, never that object.
    stray = store.scoped(f"jobs/{other_id}")
    with db_engine.begin() as conn:
        conn.execute(
            update(StoredFile)
            .where(StoredFile.id == outputs[job_id]["error_file_id"])
            .values(uri=stray.uri("results.jsonl"))
        )
        ids = list(outputs[job_id].values())
        conn.execute(update(StoredFile).where(StoredFile.id.in_(ids)).values(expires_at=time.time() - 1))

    assert delete_expired_files(db_engine, store) == ExpiredFiles(files=2, bytes=18 + 9)
    # (the stray row's own object stays: only what a row names under its folder is deleted)
    kept = [f"jobs/{job_id}/errors.jsonl", f"jobs/{other_id}/errors.jsonl", f"jobs/{other_id}/results.jsonl"]
    assert sorted(store.list()) == kept
    with db_engine.connect() as conn:
        left = sorted(conn.execute(select(Item.job_id, Item.custom_id)).all())
    assert left == [(other_id, "r1"), (other_id, "r2")]
    for file_id in ids:
        with pytest.raises(FileExpired, match=f"File {file_id} expired at .* and was deleted"):
            get_file(db_engine, file_id, "key_a")
        with pytest.raises(FileNotFound, match="No such File object"):  # another key is told nothing more
            get_file(db_engine, file_id, "key_b")
    with pytest.raises(NoUnfinished, match=f"job {job_id}'s output files expired at"):
        open_unfinished(db_engine, store, job_id)
