"""Where a webhook may be delivered: the URL's host resolved, every address it resolves to
public (global unicast), and the connection made to the checked addresses only (the next one
when one cannot be reached), so that a
second DNS answer cannot send it elsewhere (DNS rebinding).

Refused: private (10/8, 172.16/12, 192.168/16, fc00::/7), loopback (unless loopback is allowed
for development), link-local (169.254/16, fe80::/10: cloud metadata), shared (100.64/10),
reserved, multicast and unspecified addresses, IPv4-mapped IPv6 forms of them included. A
host with one bad address among good ones is refused as a whole.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from conveyor.worker.core.webhook_urls import WebhookUrl, parse_url

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class DestinationRefused(ValueError):
    """A webhook destination that is not allowed (the message says why)."""


class HostNotResolved(DestinationRefused):
    """The host did not resolve (now): refused when registered, retried when delivering, as
    a DNS outage passes."""


@dataclass(frozen=True)
class Destination:
    url: WebhookUrl
    addresses: tuple[str, ...]  # the checked addresses, one of which the connection goes to


def address_problem(address: IPAddress, *, allow_loopback: bool) -> str | None:
    """Why ``address`` may not receive webhooks, or None."""
    mapped = getattr(address, "ipv4_mapped", None)
    address = mapped or address
    if address.is_loopback:
        return None if allow_loopback else "a loopback address"
    if address.is_unspecified:
        return "an unspecified address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_private:
        return "a private address"
    if address.is_multicast:
        return "a multicast address"
    if address.is_reserved or not address.is_global:
        return "not a public address"
    return None


def resolve(url: WebhookUrl, *, allow_loopback: bool) -> Destination:
    """Resolve ``url``'s host and check every address; ``DestinationRefused`` if one is bad
    or the name does not resolve."""
    try:
        infos = socket.getaddrinfo(url.host, url.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise HostNotResolved(f"the webhook host {url.host!r} does not resolve: {exc}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise HostNotResolved(f"the webhook host {url.host!r} has no address")
    for text in addresses:
        problem = address_problem(ipaddress.ip_address(text.split("%", 1)[0]), allow_loopback=allow_loopback)
        if problem is not None:
            raise DestinationRefused(f"the webhook host {url.host!r} resolves to {text}, {problem}: refused")
    return Destination(url, tuple(addresses))


def check_destination(raw: str, *, allow_loopback: bool) -> Destination:
    """``raw`` as written and where it resolves to, checked; ``DestinationRefused`` otherwise."""
    try:
        url = parse_url(raw, allow_loopback=allow_loopback)
    except ValueError as exc:
        raise DestinationRefused(str(exc)) from None
    return resolve(url, allow_loopback=allow_loopback)
