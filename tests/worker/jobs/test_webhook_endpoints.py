"""A key's webhook endpoints on both databases: what cannot be stored is refused naming the
field, an id that cannot be one is simply not found, and another key's is not found either."""

from __future__ import annotations

import pytest

from conveyor.worker.core.storable_text import UnstorableText
from conveyor.worker.core.webhook_destination import DestinationRefused
from conveyor.worker.jobs.webhook_endpoints import (
    EndpointNotFound,
    create_endpoint,
    delete_endpoint,
    get_endpoint,
    list_endpoints,
    update_endpoint,
)

URL = "https://127.0.0.1:9/hook"


def test_endpoints_are_checked_and_kept_per_key(db_engine) -> None:
    made = create_endpoint(db_engine, "key-a", url=URL, event_types=["batch.failed"], allow_loopback=True)
    assert made["signing_secret"].startswith("whsec_") and made["id"].startswith("we_")
    assert "signing_secret" not in get_endpoint(db_engine, "key-a", made["id"])
    with pytest.raises(UnstorableText, match="name must be text without NUL") as bad:
        create_endpoint(db_engine, "key-a", url=URL, event_types=["batch.failed"], name="a\x00b", allow_loopback=True)
    assert bad.value.field == "name"
    with pytest.raises(UnstorableText, match="url must be text without NUL"):
        update_endpoint(db_engine, "key-a", made["id"], url=URL + "\x00", allow_loopback=True)
    with pytest.raises(DestinationRefused, match="control characters"):
        update_endpoint(db_engine, "key-a", made["id"], url=URL + "\x01", allow_loopback=True)
    with pytest.raises(DestinationRefused, match="loopback"):  # without the development flag
        update_endpoint(db_engine, "key-a", made["id"], url="https://127.0.0.2/other")
    for odd in ("we_\x00", "we_" + "\ud800" * 4, "../x", made["id"].upper()):
        with pytest.raises(EndpointNotFound):
            get_endpoint(db_engine, "key-a", odd)
    with pytest.raises(EndpointNotFound):
        get_endpoint(db_engine, "key-b", made["id"])
    with pytest.raises(EndpointNotFound):
        delete_endpoint(db_engine, "key-b", made["id"])
    assert list_endpoints(db_engine, "key-b")["data"] == []
    assert [e["id"] for e in list_endpoints(db_engine, "key-a")["data"]] == [made["id"]]
    with pytest.raises(ValueError, match="belong to an API key"):
        create_endpoint(db_engine, None, url=URL, event_types=["batch.failed"], allow_loopback=True)
