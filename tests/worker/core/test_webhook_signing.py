"""Standard Webhooks signatures as the ``openai`` SDK verifies them."""

from __future__ import annotations

import base64
import time

import openai
import pytest

from conveyor.worker.core.webhook_signing import new_secret, secret_bytes, secret_hint, signed_headers


def _sdk() -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


def test_a_signature_verifies_with_the_openai_sdk_and_a_changed_body_does_not() -> None:
    secret = new_secret()
    body = b'{"id":"evt_1","object":"event","type":"batch.completed","created_at":1,"data":{"id":"batch_1"}}'
    headers = signed_headers([secret], "evt_1", int(time.time()), body)
    event = _sdk().webhooks.unwrap(body, headers, secret=secret)
    assert event.type == "batch.completed" and event.data.id == "batch_1" and event.id == "evt_1"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        _sdk().webhooks.verify_signature(body.replace(b"batch_1", b"batch_2"), headers, secret=secret)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        _sdk().webhooks.verify_signature(body, headers, secret=new_secret())


def test_during_a_rotation_either_secret_verifies() -> None:
    old, new = new_secret(), new_secret()
    body = b"{}"
    headers = signed_headers([new, old], "evt_2", int(time.time()), body)
    assert len(headers["webhook-signature"].split()) == 2
    for secret in (old, new):
        _sdk().webhooks.verify_signature(body, headers, secret=secret)


def test_secrets_are_checked_and_hinted_without_being_shown() -> None:
    secret = new_secret()
    assert len(secret_bytes(secret)) == 32 and secret.startswith("whsec_")
    assert secret_hint(secret) == f"whsec_...{secret[-4:]}" and secret[6:-4] not in secret_hint(secret)
    with pytest.raises(ValueError, match="start with 'whsec_'"):
        secret_bytes("abc")
    with pytest.raises(ValueError, match="base64"):
        secret_bytes("whsec_not base64!")
    with pytest.raises(ValueError, match="24 to 64 bytes"):
        secret_bytes("whsec_" + base64.b64encode(b"short").decode())
    with pytest.raises(ValueError, match="no secret"):
        signed_headers([], "evt", 0, b"")
