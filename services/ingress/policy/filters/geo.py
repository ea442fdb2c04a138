"""Client address and region (DESIGN, "Geo hotspots").

The client address comes from ``X-Forwarded-For`` only as far as it can be trusted:
the "rightmost untrusted address" rule. Each proxy appends the address it received the
request from, so an entry is only as honest as the hop that appended it — the hop to
its right, the rightmost entry having been appended by the TCP peer. Starting from the
peer, while the current hop lies in a trusted proxy network (``TrustedProxies``,
``SEAWALL_TRUSTED_PROXIES``), the walk steps one entry left; the first address outside
every trusted network is the client. Everything further left is whatever the client
chose to send, and is never read.

A peer outside the trusted networks is the client itself, whatever header it sent: a
client that connects directly cannot forge another's address (it used to, when a count
of hops was trusted whoever the peer was: its forged address then fed the failed-login
lockouts keyed by (address, key id), and the region). No trusted network at all: the
peer is always the client.

Regions come from a CIDR → region table; the longest matching prefix wins.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Iterator, Mapping, Sequence
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


MAX_FORWARDED_HOPS = 32
"""Entries of ``X-Forwarded-For`` walked at most, from the right: no deployment has this
many proxies, and a header of thousands of entries costs no more than 32."""


class TrustedProxies:
    """The networks of the proxies in front of ingress, whose ``X-Forwarded-For``
    entries are believed. Compiled once (a network and mask as integers per CIDR), so
    a membership test is a few integer operations."""

    def __init__(self, cidrs: Iterable[str] = ()) -> None:
        networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for cidr in cidrs:
            text = cidr.strip()
            if not text:
                continue
            # strict=False: "10.1.2.3/8" means 10.0.0.0/8, as operators tend to write it;
            # a bare address is its /32 (/128). A bad entry fails at start-up.
            networks.append(ipaddress.ip_network(text, strict=False))
        self.networks = tuple(networks)
        self._masks = {
            version: tuple(
                (int(n.network_address), int(n.netmask)) for n in networks if n.version == version
            )
            for version in (4, 6)
        }

    def __contains__(self, ip: IPAddress) -> bool:
        value = int(ip)
        return any(value & mask == net for net, mask in self._masks[ip.version])

    def __bool__(self) -> bool:
        return bool(self.networks)

    def __repr__(self) -> str:
        return f"TrustedProxies({[str(n) for n in self.networks]!r})"


def _from_the_right(headers: str | Sequence[str] | None, limit: int) -> Iterator[str]:
    """The entries of ``X-Forwarded-For`` right to left, at most ``limit`` of them
    (empty ones skipped but counted): only the part that is walked is split."""
    if headers is None:
        return
    lines = [headers] if isinstance(headers, str) else list(headers)
    taken = 0
    for line in reversed(lines):
        if taken >= limit:
            return
        # limit - taken splits give the entries still wanted, and one more piece (the
        # unsplit rest of the line) that the bound below never reaches.
        for part in reversed(line.rsplit(",", limit - taken)):
            if taken >= limit:
                return
            taken += 1
            entry = part.strip()
            if entry:
                yield entry


def client_address(
    x_forwarded_for: str | Sequence[str] | None,
    peer: str | None,
    trusted: TrustedProxies,
) -> ClientAddress:
    """The rightmost address not in a ``trusted`` network, walking from the TCP peer
    leftwards through ``X-Forwarded-For`` (module notes).

    - A peer that is not an address (a Unix socket, none at all): unknown (``none``);
      the header is not read, nobody vouches for it.
    - An untrusted peer: the peer (``peer``); the header is ignored.
    - A malformed entry stops the walk at the hop that appended it: the last trusted
      one, whose own address we know. That is the safe answer: the garbage was written
      by (or passed on unchecked past) a proxy we trust, the entries to its left are
      no more reliable than it, and skipping over it would let a client who controls
      what ends up there choose an address.
    - Every entry trusted (an internal client behind our proxies), or
      ``MAX_FORWARDED_HOPS`` walked: the last entry reached, which a trusted hop
      appended.
    """
    hop = parse_ip(peer) if peer is not None else None
    if hop is None:
        return ClientAddress(None, "none")
    if hop not in trusted:
        return ClientAddress(hop, "peer")
    source: Source = "peer"
    for entry in _from_the_right(x_forwarded_for, MAX_FORWARDED_HOPS):
        ip = parse_ip(entry)
        if ip is None:
            break
        hop, source = ip, "forwarded"
        if ip not in trusted:
            break
    return ClientAddress(hop, source)


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
