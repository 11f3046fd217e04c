"""The prefix cache is shared only within one owner: the "guess the PIN" attack of issue 22,
through the ``openai`` SDK against the API server and a real worker. One tenant runs a prompt
holding a PIN; another sends guesses of the same template. Before the cache was salted per
owner, only the right guess reported every full block as ``cached_tokens``."""

from __future__ import annotations

import json
from typing import Any, Final

import openai

from conveyor.worker.core.settings import Settings
from conveyor.worker.jobs.cache_salt import cache_salt
from tests.worker.api_batches import MODEL, wait_batch
from tests.worker.helpers import jsonl

COMPLETIONS: Final = "/v1/completions"
BEFORE = "Account notes for the branch office. The customer asked us to keep this on file. " * 2
AFTER = " Never read it out on the phone, never write it in an email, and shred this note after use. " * 2
PIN = "4729"
GUESSES = ["1111", "0420", "9999", "4728", PIN, "7294", "2947", "1234", "0000", "4792"]


def template(pin: str) -> str:
    return f"{BEFORE}Bank PIN {pin}.{AFTER}"


def run_batch(client: openai.OpenAI, prompts: dict[str, str]) -> dict[str, dict[str, Any]]:
    """custom_id -> usage of each line, once the batch completed."""
    rows = [
        {"custom_id": cid, "method": "POST", "url": COMPLETIONS,
         "body": {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}}
        for cid, prompt in prompts.items()
    ]  # fmt: skip
    file = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=COMPLETIONS, completion_window="24h")
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed" and batch.output_file_id, batch
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    return {line["custom_id"]: line["response"]["body"]["usage"] for line in lines}


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_a_second_owner_cannot_read_a_pin_off_cached_tokens(embedded_stack, serve, spawn_worker) -> None:
    worker = spawn_worker(embedded_stack, served_model_name=MODEL)
    server = serve(embedded_stack)
    # The SDK waits up to 180 s for an answer: on CI's two loaded cores one create once took
    # longer than the usual 60 s (what is asserted here is isolation, not latency).
    victim = server.client(server.new_key("victim"), timeout=180.0)
    attacker = server.client(server.new_key("attacker"), timeout=180.0)
    worker.wait_ready()

    secret = run_batch(victim, {"secret": template(PIN)})["secret"]
    assert cached(secret) == 0
    # The attacker warms the template with a wrong PIN of its own, then guesses in one batch.
    warm = run_batch(attacker, {"warm": template("5555")})["warm"]
    assert cached(warm) == 0  # nothing of the victim's, not even the text before the PIN
    guesses = run_batch(attacker, {f"guess-{g}": template(g) for g in GUESSES})
    seen = {g: cached(guesses[f"guess-{g}"]) for g in GUESSES}
    assert len(set(seen.values())) == 1, seen  # the right guess looks like every wrong one
    assert 0 < seen[PIN] < secret["prompt_tokens"] - 16  # the attacker's own warm-up: its prefix

    # Each owner still gets its own prefix-cache hits: the victim, every full block of its prompt.
    again = run_batch(victim, {"again": template(PIN)})["again"]
    assert cached(again) == (again["prompt_tokens"] - 1) // 16 * 16 > seen[PIN]


def test_the_salt_names_the_owner_the_operator_or_the_job(tmp_path) -> None:
    settings = Settings(home=tmp_path)
    assert cache_salt(settings, "batch_1", "key_a") == cache_salt(settings, "batch_2", "key_a") == "owner:key_a"
    assert cache_salt(settings, "batch_1", "key_b") != cache_salt(settings, "batch_1", "key_a")
    # Without a key (the CLI, a broker producer): each job alone, unless the operator names one.
    assert cache_salt(settings, "job_1", None) != cache_salt(settings, "job_2", None)
    operator = Settings(home=tmp_path, unowned_cache_salt="ops")
    assert cache_salt(operator, "job_1", None) == cache_salt(operator, "job_2", None) != "owner:ops"
    # Sharing across owners only where the operator asks for it.
    assert cache_salt(Settings(home=tmp_path, cache_sharing="global"), "batch_1", "key_a") is None


def _cached_of(client, job_id: str) -> int:
    (line,) = [json.loads(text) for text in client.results(job_id)]
    return cached(line["response"]["body"]["usage"])


def test_jobs_without_a_key_share_only_where_the_operator_says(embedded_stack, spawn_worker) -> None:
    """``conveyor submit`` (and a broker producer) has no API key: each job is its own owner,
    unless the operator names one salt for all of them (``CONVEYOR_UNOWNED_CACHE_SALT``)."""
    from conveyor.worker.entrypoints.client import Client
    from tests.worker.helpers import jsonl as to_jsonl

    line = {"custom_id": "pin", "method": "POST", "url": COMPLETIONS,
            "body": {"prompt": template(PIN), "max_tokens": 2, "temperature": 0}}  # fmt: skip
    for salt, expect_shared in (("", False), ("ops-team", True)):
        stack = embedded_stack.with_values(
            unowned_cache_salt=salt, queue_prefix=f"{embedded_stack.values['queue_prefix']}{len(salt)}"
        )
        worker = spawn_worker(stack)
        worker.wait_ready()
        client = Client(stack.settings)
        first = client.wait(client.submit(to_jsonl([line]), stack.model)["id"], timeout=120)
        second = client.wait(client.submit(to_jsonl([line]), stack.model)["id"], timeout=120)
        assert first["status"] == second["status"] == "completed"
        assert _cached_of(client, first["id"]) == 0
        assert (_cached_of(client, second["id"]) > 0) is expect_shared, salt
        client.close()
        worker.stop()
