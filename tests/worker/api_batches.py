"""Batches through the HTTP API: the lines they carry and the batch objects they answer."""

from __future__ import annotations

import time
from typing import Any

import openai
from openai.types import Batch

from tests.worker.helpers import openai_lines

CHAT = "/v1/chat/completions"
TERMINAL = ("completed", "failed", "expired", "cancelled")


MODEL = "tiny-chat"  # the public name the workers serve the tiny checkpoint under


def batch_lines(n: int, *, model: str = MODEL, prefix: str = "req", **kw: Any) -> list[dict[str, Any]]:
    """OpenAI Batch lines naming ``model`` in their body, as OpenAI's require."""
    lines = openai_lines(n, prefix=prefix, **kw)
    for line in lines:
        line["body"]["model"] = model
    return lines


def raw_batch(client: openai.OpenAI, batch_id: str) -> dict[str, Any]:
    data: dict[str, Any] = client.batches.with_raw_response.retrieve(batch_id).http_response.json()
    return data


def check_api_batch(data: dict[str, Any]) -> Batch:
    """The answer validates as the SDK's ``Batch`` with strict types and nothing extra."""
    batch = Batch.model_validate(data, strict=True)
    assert not batch.model_extra, batch.model_extra  # no field the SDK does not know
    assert not batch.request_counts or not batch.request_counts.model_extra
    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert batch.expires_at is not None and batch.expires_at > batch.created_at
    return batch


def wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = 120.0, until=TERMINAL) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = check_api_batch(raw_batch(client, batch_id))
        if batch.status in until:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch still {batch.status} after {timeout} s: {batch}")
        time.sleep(0.2)
