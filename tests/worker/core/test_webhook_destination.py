"""Where webhooks may go: https to public addresses only, checked after DNS."""

from __future__ import annotations

import pytest

from conveyor.worker.core.settings import ConfigError, read_settings
from conveyor.worker.core.webhook_destination import DestinationRefused, check_destination
from conveyor.worker.core.webhook_signing import new_secret


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://10.1.2.3/hook", "private"),
        ("https://172.16.0.9/hook", "private"),
        ("https://192.168.1.1/hook", "private"),
        ("https://127.0.0.1/hook", "loopback"),
        ("https://localhost:8443/hook", "loopback"),  # after DNS
        ("https://169.254.169.254/latest/meta-data", "link-local"),
        ("https://[fe80::1]/hook", "link-local"),
        ("https://[::ffff:10.0.0.1]/hook", "private"),  # IPv4-mapped
        ("https://[::1]/hook", "loopback"),
        ("https://100.64.0.1/hook", "not a public address"),
        ("https://0.0.0.0/hook", "unspecified"),
        ("https://224.0.0.1/hook", "multicast"),
        ("http://93.184.216.34/hook", "must be https"),
        ("ftp://93.184.216.34/hook", "must be https"),
        ("https://user:pw@93.184.216.34/hook", "credentials"),
        ("https:///hook", "must name a host"),
        ("https://no-such-host.invalid/hook", "does not resolve"),
        ("https://93.184.216.34/" + "a" * 2100, "at most 2048"),
    ],
)
def test_private_and_malformed_destinations_are_refused_with_the_reason(url: str, why: str) -> None:
    with pytest.raises(DestinationRefused, match=why):
        check_destination(url, allow_loopback=False)


def test_a_public_address_passes_and_the_connection_goes_to_it() -> None:
    dest = check_destination("https://93.184.216.34:8443/a/b?c=d", allow_loopback=False)
    assert dest.addresses == ("93.184.216.34",)
    assert (dest.url.host, dest.url.port, dest.url.target) == ("93.184.216.34", 8443, "/a/b?c=d")


def test_loopback_is_allowed_only_with_the_development_flag() -> None:
    assert check_destination("https://127.0.0.1:9/x", allow_loopback=True).addresses == ("127.0.0.1",)
    assert "127.0.0.1" in check_destination("http://localhost:9/x", allow_loopback=True).addresses
    with pytest.raises(DestinationRefused, match="must be https"):  # plain http still only to loopback
        check_destination("http://93.184.216.34/x", allow_loopback=True)
    with pytest.raises(DestinationRefused, match="private"):
        check_destination("https://10.0.0.1/x", allow_loopback=True)


def test_operator_settings_are_checked_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CONVEYOR_WEBHOOK_URLS", "CONVEYOR_WEBHOOK_SECRET"):
        monkeypatch.delenv(name, raising=False)
    secret = new_secret()
    settings = read_settings(webhook_urls="https://a.example/x, https://b.example/y", webhook_secret=secret)
    assert settings.webhook_urls == ("https://a.example/x", "https://b.example/y")
    assert secret not in repr(settings) and settings.safe_dict()["webhook_secret"] == "***"
    tokened = read_settings(webhook_urls="https://a.example/x?token=s3cret", webhook_secret=secret)
    assert "s3cret" not in repr(tokened) and "s3cret" not in str(tokened.safe_dict())
    monkeypatch.setenv("CONVEYOR_WEBHOOK_URLS", "https://a.example/x,https://b.example/y")
    monkeypatch.setenv("CONVEYOR_WEBHOOK_SECRET", secret)
    assert read_settings().webhook_urls == ("https://a.example/x", "https://b.example/y")
    monkeypatch.delenv("CONVEYOR_WEBHOOK_SECRET")
    with pytest.raises(ConfigError, match="CONVEYOR_WEBHOOK_URLS needs CONVEYOR_WEBHOOK_SECRET"):
        read_settings()
    with pytest.raises(ConfigError, match=r"CONVEYOR_WEBHOOK_URLS.*must be https"):
        read_settings(webhook_urls="ftp://a.example/x")
    with pytest.raises(ConfigError, match=r"CONVEYOR_WEBHOOK_SECRET.*whsec_"):
        read_settings(webhook_secret="plain")
