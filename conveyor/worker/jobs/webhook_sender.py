"""One webhook delivery attempt: an HTTPS POST to a checked address.

The destination is checked first (``conveyor.worker.core.webhook_destination``: https, every
address the host resolves to public) and the connection goes to an address that was
checked, with the URL's host name as SNI, certificate name and ``Host``, so a DNS answer that
changes between the check and the connection cannot redirect it. Redirects are not followed:
a 3xx is a failed attempt naming its ``Location`` (a receiver registers its final URL), which
also means no redirect can lead to a private address. Connect and read each have a timeout,
the whole reply must come within twice the timeout, and at most 64 KiB of it is read. A 2xx
answer delivers; a refused destination fails for good (a name that does not resolve is retried);
anything else is retried.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import urllib3

from conveyor.worker.core.storable_text import storable
from conveyor.worker.core.webhook_destination import DestinationRefused, HostNotResolved, check_destination
from conveyor.worker.core.webhook_urls import WebhookUrl

MAX_REPLY_BYTES = 64 * 1024
USER_AGENT = "Conveyor-Webhooks/1"
ERROR_CHARS = 500


@dataclass(frozen=True)
class AttemptResult:
    delivered: bool
    status_code: int | None = None
    error: str | None = None
    permanent: bool = False  # no retry can help (a refused destination)


def post_event(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    allow_loopback: bool,
    timeout: float,
    ca_bundle: Path | None = None,
) -> AttemptResult:
    """POST ``body`` to ``url`` once; never raises for what the destination does."""
    try:
        dest = check_destination(url, allow_loopback=allow_loopback)
    except DestinationRefused as exc:  # for good, unless the name did not resolve (a DNS outage passes)
        return AttemptResult(False, error=str(exc), permanent=not isinstance(exc, HostNotResolved))
    target = dest.url
    default_port = 443 if target.scheme == "https" else 80
    host_header = target.host if target.port == default_port else f"{target.host}:{target.port}"
    if ":" in target.host and target.port != default_port:
        host_header = f"[{target.host}]:{target.port}"
    all_headers = {
        **headers, "Host": host_header, "Content-Type": "application/json", "User-Agent": USER_AGENT,
    }  # fmt: skip
    deadline = time.monotonic() + 2 * timeout
    reply: urllib3.BaseHTTPResponse | None = None
    error = "no address to connect to"
    for address in dest.addresses:
        try:
            reply, text = _post(address, target, body, all_headers, timeout, ca_bundle, deadline)
            break
        except (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError) as exc:
            error = f"cannot connect to {address}: {_why(exc)}"  # the next address, if any
        except urllib3.exceptions.HTTPError as exc:
            return AttemptResult(False, error=f"{type(exc).__name__}: {_why(exc)}")
    if reply is None:
        return AttemptResult(False, error=error)
    code = reply.status
    if 200 <= code < 300:
        return AttemptResult(True, status_code=code)
    if 300 <= code < 400:
        where = storable(reply.headers.get("location") or "")[:ERROR_CHARS]
        return AttemptResult(
            False,
            code,
            f"HTTP {code}: redirect to {where!r} refused (webhooks are not redirected; register the final URL)",
        )
    return AttemptResult(False, code, f"HTTP {code}: {storable(text)[:ERROR_CHARS]}".rstrip(": "))


def _post(
    address: str,
    target: WebhookUrl,
    body: bytes,
    headers: dict[str, str],
    timeout: float,
    ca_bundle: Path | None,
    deadline: float,
) -> tuple[urllib3.BaseHTTPResponse, str]:
    """One POST to ``address`` (checked) for ``target``; the reply and its first bytes."""
    pool_timeout = urllib3.Timeout(connect=timeout, read=timeout)
    pool: urllib3.HTTPConnectionPool
    if target.scheme == "https":
        pool = urllib3.HTTPSConnectionPool(
            address, target.port, timeout=pool_timeout, retries=False, maxsize=1,
            cert_reqs="CERT_REQUIRED", ca_certs=str(ca_bundle) if ca_bundle else None,
            server_hostname=target.host, assert_hostname=target.host,
        )  # fmt: skip
    else:  # http: only to loopback, allowed for development (checked by check_destination)
        pool = urllib3.HTTPConnectionPool(address, target.port, timeout=pool_timeout, retries=False, maxsize=1)
    try:
        reply = pool.urlopen(
            "POST", target.target, body=body, headers=headers, redirect=False, retries=False,
            preload_content=False, assert_same_host=False,
        )  # fmt: skip
        try:
            return reply, _read_capped(reply, deadline=deadline)
        finally:
            reply.release_conn()
    finally:
        pool.close()


def _why(exc: Exception) -> str:
    return storable(str(exc))[:ERROR_CHARS]


def _read_capped(reply: urllib3.BaseHTTPResponse, *, deadline: float) -> str:
    """At most ``MAX_REPLY_BYTES`` of the reply, and only until ``deadline``."""
    got = bytearray()
    while len(got) < MAX_REPLY_BYTES and time.monotonic() < deadline:
        chunk = reply.read(min(8192, MAX_REPLY_BYTES - len(got)))
        if not chunk:
            break
        got += chunk
    return got.decode("utf-8", "replace")
