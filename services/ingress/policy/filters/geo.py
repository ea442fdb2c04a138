"""Client address and region (DESIGN, "Geo hotspots").

The client address comes from ``X-Forwarded-For`` only as far as it can be trusted.
Each proxy appends the address it received the request from, so with N trusted proxies
in front of ingress (the nearest being the TCP peer) the entries to the right were
written by our own proxies and the N-th entry from the right is the first hop none of
them vouches for: the client. Anything further left is whatever the client chose to
send. With N = 0, or a header shorter than N entries (the request did not pass through
every proxy), or an unparseable entry at that position, the peer address is used.

Regions come from a CIDR → region table; the longest matching prefix wins.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Source = Literal["forwarded", "peer", "none"]


@dataclass(frozen=True, slots=True)
class ClientAddress:
    ip: IPAddress | None
    source: Source
    """``forwarded``: from X-Forwarded-For; ``peer``: the TCP peer; ``none``: unknown."""


def parse_ip(value: str) -> IPAddress | None:
    """An address from a header entry or a peer string; ``None`` if it is not one.

    Accepts ``1.2.3.4``, ``1.2.3.4:567``, ``2001:db8::1``, ``[2001:db8::1]:443`` and
    unwraps IPv4-mapped IPv6 (``::ffff:1.2.3.4``); drops an IPv6 zone (``%eth0``).
    """
    s = value.strip().strip('"')
    if s.startswith("["):
        close = s.find("]")
        if close < 0:
            return None
        s = s[1:close]
    elif s.count(":") == 1:
        s = s.split(":", 1)[0]
    s = s.split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(s)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def forwarded_entries(headers: str | Sequence[str] | None) -> list[str]:
    """The entries of one or several ``X-Forwarded-For`` header lines, in order."""
    if headers is None:
        return []
    lines = [headers] if isinstance(headers, str) else list(headers)
    return [e.strip() for line in lines for e in line.split(",") if e.strip()]


def client_address(
    x_forwarded_for: str | Sequence[str] | None,
    peer: str | None,
    trusted_proxies: int,
) -> ClientAddress:
    """The first untrusted hop, counting ``trusted_proxies`` from the right."""
    if trusted_proxies < 0:
        raise ValueError("trusted_proxies must not be negative")
    entries = forwarded_entries(x_forwarded_for)
    if 0 < trusted_proxies <= len(entries):
        ip = parse_ip(entries[-trusted_proxies])
        if ip is not None:
            return ClientAddress(ip, "forwarded")
    ip = parse_ip(peer) if peer is not None else None
    return ClientAddress(ip, "peer" if ip is not None else "none")


class RegionTable:
    """CIDR → region; lookups cost one dict probe per distinct prefix length."""

    def __init__(self, entries: Mapping[str, str] | Iterable[tuple[str, str]]) -> None:
        pairs = entries.items() if isinstance(entries, Mapping) else entries
        self._by_len: dict[
            tuple[int, int], dict[ipaddress.IPv4Network | ipaddress.IPv6Network, str]
        ] = {}
        for cidr, region in pairs:
            # strict=False: "10.1.2.3/8" means 10.0.0.0/8, as operators tend to write it.
            net = ipaddress.ip_network(cidr.strip(), strict=False)
            self._by_len.setdefault((net.version, net.prefixlen), {})[net] = region
        self._lengths = sorted(self._by_len, key=lambda k: -k[1])

    def lookup(self, ip: IPAddress | None) -> str | None:
        if ip is None:
            return None
        for version, prefixlen in self._lengths:
            if version != ip.version:
                continue
            net = ipaddress.ip_network((ip, prefixlen), strict=False)
            region = self._by_len[(version, prefixlen)].get(net)
            if region is not None:
                return region
        return None
