"""Where a webhook may be sent: the check of a target URL against the internal network (SSRF).

A webhook must not become a way into the network the service runs in (``../shared/pitfalls.md``,
"Operating it"). ``target_check`` parses the URL (``http`` or ``https``, a host, no credentials),
resolves the host and refuses it unless **every** address it resolves to is public: not private,
loopback, link-local (169.254.169.254, the cloud metadata service, among them), multicast, reserved,
unspecified, shared (100.64.0.0/10), nor any of these wrapped in IPv6 (IPv4-mapped ``::ffff:a.b.c.d``,
6to4, Teredo). The sender connects to the address checked here (``worker/webhooks.py``: the request
goes to the IP, with the ``Host`` header and TLS SNI of the name), so a DNS answer that changes
between the check and the connection changes nothing. It is checked when an endpoint is registered or
changed (a 400 with the reason) and again before every attempt (a failed attempt with the reason).

An operator lets private targets through with ``HERMES_WEBHOOK_ALLOW_PRIVATE=1`` (all of them) or
``HERMES_WEBHOOK_ALLOWED_NETWORKS`` (CIDRs, e.g. ``10.1.2.0/24,fd00::/8``).
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Networks ``ipaddress`` does not flag but that are no public target either: shared address space
#: (RFC 6598, carrier-grade NAT) and the benchmarking range (RFC 2544).
_NOT_PUBLIC = (ipaddress.ip_network("100.64.0.0/10"), ipaddress.ip_network("198.18.0.0/15"))


class TargetRefused(ValueError):
    """The URL is not one a webhook may be sent to; the message says why (shown to the client as is)."""


@dataclass(frozen=True)
class CheckedTarget:
    """A URL whose host resolved to allowed addresses only: ``addresses`` in the resolver's order
    (connect to the first), ``host`` the name for the ``Host`` header and TLS SNI, ``port`` the port."""

    url: str
    scheme: str
    host: str
    port: int
    addresses: tuple[str, ...]


def _inner_addresses(ip: IPAddress) -> list[IPAddress]:
    """``ip`` and the IPv4 addresses an IPv6 one carries (mapped, 6to4, Teredo): each must pass."""
    found: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        for inner in (ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())):
            if inner is not None:
                found.append(inner)
    return found


def address_refusal(ip: IPAddress) -> str:
    """Why ``ip`` may not be a webhook target (``""``: it may) under the operator's settings."""
    if settings.HERMES_WEBHOOK_ALLOW_PRIVATE:
        return ""
    allowed = [ipaddress.ip_network(cidr, strict=False) for cidr in settings.HERMES_WEBHOOK_ALLOWED_NETWORKS]
    if any(ip.version == net.version and ip in net for net in allowed):
        return ""
    for inner in _inner_addresses(ip):
        for flag in ("loopback", "private", "link_local", "multicast", "reserved", "unspecified"):
            if getattr(inner, f"is_{flag}"):
                return f"{ip} is a {flag.replace('_', '-')} address"
        if any(inner.version == net.version and inner in net for net in _NOT_PUBLIC) or not inner.is_global:
            return f"{ip} is not a public address"
    return ""


def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to for a TCP connection to ``port`` (``socket.getaddrinfo``:
    the system's resolver and ``/etc/hosts``), in its order, without repeats; raises ``OSError``."""
    seen: dict[str, None] = {}
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        seen.setdefault(str(sockaddr[0]).split("%", 1)[0], None)
    return list(seen)


def _host_and_port(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of ``url``, or ``TargetRefused``."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise TargetRefused(f"not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https"):
        raise TargetRefused("the URL's scheme must be http or https")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("the URL must not carry credentials (user:password@); sign with the secret instead")
    if not parts.hostname:
        raise TargetRefused("the URL has no host")
    return parts.scheme, parts.hostname, port


def _addresses(host: str, port: int) -> tuple[list[str], bool]:
    """The addresses of ``host`` and whether it was one already (an IP literal), or ``TargetRefused``."""
    try:
        return [str(ipaddress.ip_address(host))], True
    except ValueError:
        pass
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise TargetRefused(f"the host {host!r} does not resolve: {exc}") from exc
    if not addresses:
        raise TargetRefused(f"the host {host!r} resolves to no address")
    return addresses, False


def target_check(url: str) -> CheckedTarget:
    """Check ``url`` (module docstring) and return where to connect; raises ``TargetRefused`` with the reason."""
    scheme, host, port = _host_and_port(url)
    addresses, literal = _addresses(host, port)
    for address in addresses:
        why = address_refusal(ipaddress.ip_address(address))
        if why:
            named = "" if literal else f"the host {host!r} resolves to {address}: "
            raise TargetRefused(f"{named}{why}; webhooks go to public addresses only unless the operator allows "
                                "private ones (HERMES_WEBHOOK_ALLOW_PRIVATE, HERMES_WEBHOOK_ALLOWED_NETWORKS)")
    return CheckedTarget(url=url, scheme=scheme, host=host, port=port, addresses=tuple(addresses))
